"""--adapter-source end to end: a real server (a tiny random Llama) and a real HTTP store on loopback
(the standard library's file server over a folder of PEFT adapters). An adapter only the store has is
fetched on its first request and answers exactly as the same files served from --adapter-dir; streams
keep going while a fetch is held; a missing or broken adapter is a 404 with the reason, for its requests
only."""
from __future__ import annotations

import functools
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import requests

from engine import envs
from tests.frontends.server_fixture import Server, metric


class Handler(SimpleHTTPRequestHandler):
    gate = threading.Event()          # answers for paths with "slow-" wait for it
    asked: list[str] = []

    def do_GET(self):
        self.asked.append(self.path)
        if "slow-" in self.path:
            self.gate.wait(60)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def store(tiny_served, tmp_path_factory):
    _, adapters = tiny_served
    root = tmp_path_factory.mktemp("store")
    shutil.copytree(adapters / "tiny-r5", root / "remote-r5")
    shutil.copytree(adapters / "tiny-r8", root / "slow-r8")
    shutil.copytree(adapters / "tiny-r8", root / "slow-r9")
    shutil.copytree(adapters / "tiny-r2", root / "preload-r2")
    shutil.copytree(adapters / "tiny-r2", root / "cut")
    weights = root / "cut" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    shutil.copytree(adapters / "tiny-r2", root / "wrong-base")       # shapes of another model
    cfg = (root / "wrong-base" / "adapter_config.json")
    cfg.write_text(cfg.read_text().replace('"q_proj"', '"no_such_proj"'))
    http = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    yield url
    http.shutdown()
    shutil.rmtree(envs.adapter_cache_dir(url), ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_served, store):
    model, adapters = tiny_served
    s = Server("--model", str(model), "--adapter-dir", str(adapters), "--adapter-source", store, "--frontends", "1",
               "--max-waiting", "3")
    yield s
    Handler.gate.set()
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused")


def complete(client, model: str, max_tokens: int = 12) -> str:
    return client.completions.create(model=model, prompt="The store holds", max_tokens=max_tokens, temperature=0,
                                     seed=1).choices[0].text


def test_an_adapter_only_the_store_has_is_fetched_and_answers_as_the_same_files_do(client, served):
    assert "remote-r5" not in [m.id for m in client.models.list().data]
    assert complete(client, "remote-r5") == complete(client, "tiny-r5")       # tiny-r5: the same files, local
    assert complete(client, "remote-r5") != complete(client, "tiny-r2")       # (the adapters do differ)
    assert "remote-r5" in [m.id for m in client.models.list().data]
    assert [p for p in Handler.asked if "remote-r5" in p] == ["/remote-r5/adapter_config.json",
                                                              "/remote-r5/adapter_model.safetensors"]
    text = requests.get(served.url + "/metrics", timeout=10).text
    assert metric(text, "loraplex_adapter_fetches_total", 'outcome="ok"') == 1
    assert metric(text, "loraplex_adapter_fetch_bytes_total") > 1000


def test_the_load_route_fetches_from_the_store(served, client):
    """POST /v1/load_lora_adapter with only a name: the store's adapter, fetched beside the steps."""
    url = served.url + "/v1/load_lora_adapter"
    ok = requests.post(url, json={"lora_name": "preload-r2"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert "preload-r2" in [m.id for m in client.models.list().data]
    assert complete(client, "preload-r2") == complete(client, "tiny-r2")
    missing = requests.post(url, json={"lora_name": "nowhere"}, timeout=60)
    assert missing.status_code == 400 and "answered HTTP 404" in missing.json()["error"]["message"]


def test_streams_go_on_while_a_fetch_is_held(client):
    Handler.gate.clear()
    got: list[str] = []

    def fetch():
        got.append(complete(client, "slow-r8", 4))
    waiting = threading.Thread(target=fetch)
    waiting.start()
    time.sleep(0.5)                                   # its request is held on the store
    stream = client.completions.create(model="tiny-r2", prompt="Meanwhile", max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) > 20 and chunks[-1].usage.completion_tokens == 40    # a whole stream meanwhile
    assert got == [] and waiting.is_alive()
    Handler.gate.set()
    waiting.join(60)
    assert got and got[0]


def test_requests_held_for_a_fetch_count_toward_max_waiting(client):
    """--max-waiting 3: three requests held on the store fill it; the next request is a 429 until they go."""
    Handler.gate.clear()
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(complete, client, "slow-r9", 2) for _ in range(3)]
        time.sleep(1.0)
        with pytest.raises(openai.RateLimitError, match="3 requests waiting"):
            client.with_options(max_retries=0).completions.create(model="tiny-r2", prompt="x", max_tokens=2)
        Handler.gate.set()
        assert all(f.result(60) for f in held)
    assert complete(client, "tiny-r2", 2)


@pytest.mark.parametrize("name, says", [
    ("not-in-store", "answered HTTP 404"),
    ("cut", "cut short"),
    ("wrong-base", "no_such_proj"),
])
def test_a_missing_or_broken_adapter_is_a_404_with_the_reason(client, name, says):
    for _ in range(2):           # the second time from what the server remembers, without asking the store
        with pytest.raises(openai.NotFoundError, match=says):
            complete(client, name)
    assert len([p for p in Handler.asked if p.startswith(f"/{name}/adapter_config")]) == 1
    assert complete(client, "tiny-r2")                # everyone else is served
