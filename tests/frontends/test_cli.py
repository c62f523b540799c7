import json
import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "frontends.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_chat_json_answers_paris():
    r = run_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop" and out["token_ids"]


def test_bad_argument_is_a_clear_error():
    r = run_cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr
