"""bench/serve_check.py (which `make gpu-check` runs with --device cuda) passes on CPU against a tiny random
Llama, and fails, naming it, when an answer is wrong."""
from __future__ import annotations

import subprocess
import sys

from bench import serve_check
from bench.tiny_model import make_tiny_llama


def test_serve_check_passes_on_cpu(tmp_path, model_dir):
    model = make_tiny_llama(tmp_path / "model", model_dir, max_positions=512)
    r = subprocess.run([sys.executable, "-m", "bench.serve_check", "--model", str(model), "--dtype", "float32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "serve_check on cpu: ok" in r.stdout and "check-r16" in r.stdout


def test_the_check_names_what_is_wrong(monkeypatch):
    """The checks themselves: a server whose adapters change nothing and whose streams differ is caught."""
    class Fake:
        def __init__(self, **_):
            self.models = self.completions = self.chat = self
            self.data, self.choices, self.usage = [], [], None

        def list(self):
            return type("L", (), {"data": [type("M", (), {"id": n}) for n in ("m", "a")]})

        def create(self, stream=False, messages=None, **_):
            usage = type("U", (), {"completion_tokens": 8})
            if messages is None:
                choice = type("C", (), {"text": "same"})
                return iter([type("K", (), {"choices": [type("C", (), {"text": "other"})]})]) if stream else \
                    type("R", (), {"choices": [choice], "usage": usage})
            msg = type("Msg", (), {"content": "hi"})
            if stream:
                return iter([type("K", (), {"choices": [type("C", (), {"delta": msg})]})])
            return type("R", (), {"choices": [type("C", (), {"message": msg})], "usage": usage})
    import openai
    monkeypatch.setattr(openai, "OpenAI", Fake)
    failed = serve_check.check("http://unused", "m", ["a"])
    assert "m: the streamed completion differs from the plain one" in failed
    assert "the adapters do not change the greedy output" in failed
