"""One bad upload does not take the service down: --adapter-dir is listed at start-up, not read; a broken
sub-folder is refused when first named (a 404 saying why, and again at once while its files are unchanged,
after which /v1/models no longer lists it), whether its config or header is refused or its weights fail to
load (NaN); the others serve; with runtime loading turned off, load and unload are refused with a 400 naming
the flag."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests
import safetensors.torch

from tests.frontends.server_fixture import Server, wait_until


@pytest.fixture(scope="module")
def server(served_adapters, tmp_path_factory):
    _, src = served_adapters
    d = tmp_path_factory.mktemp("mixed")
    shutil.copytree(src / "r4-qv", d / "good")
    shutil.copytree(src / "r4-qv", d / "broken-weights")
    (d / "broken-weights" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    (d / "broken-config").mkdir()
    (d / "broken-config" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": -3}))
    shutil.copytree(src / "r4-qv", d / "bad name!")
    shutil.copytree(src / "r4-qv", d / "nan-weights")        # a valid file and header, a NaN in its weights
    weights = safetensors.torch.load_file(d / "nan-weights" / "adapter_model.safetensors")
    next(iter(weights.values())).view(-1)[3] = float("nan")
    safetensors.torch.save_file(weights, d / "nan-weights" / "adapter_model.safetensors")
    for i in range(100):        # unreadable folders: listed, since start-up reads none of them
        (d / f"unread-{i}").mkdir()
        (d / f"unread-{i}" / "adapter_config.json").write_text("{ not json")
    s = Server("--adapter-dir", str(d), "--frontends", "1", "--disable-runtime-lora")
    yield s, src
    assert s.stop() == 0


def test_broken_adapters_are_skipped_and_named_in_the_error(server):
    s, _ = server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    models = {m.id for m in client.models.list().data}
    assert {"good", "broken-weights", "broken-config"} <= models and "bad name!" not in models   # listed, unread
    assert {f"unread-{i}" for i in range(100)} <= models
    assert client.completions.create(model="good", prompt="Hi", max_tokens=3).choices[0].text is not None
    refused = (("broken-weights", "safetensors"), ("broken-config", "r must be a positive integer"),
               ("nan-weights", "NaN or infinite"))
    for first in (True, False):          # the second time from memory, with the same reason
        for name, why in refused:
            with pytest.raises(openai.NotFoundError) as e:
                client.completions.create(model=name, prompt="Hi", max_tokens=3)
            message = e.value.body["message"]
            said = "failed to load" if first and name == "nan-weights" else "not available"     # once loaded
            assert name in message and why in message and said in message, message
    assert wait_until(lambda: not {m.id for m in client.models.list().data} & {name for name, _ in refused})
    assert "good" in {m.id for m in client.models.list().data}
    assert requests.get(s.url + "/health").status_code == 200


def test_runtime_loading_can_be_turned_off(server):
    s, src = server
    r = requests.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(src / "r8-all")})
    assert r.status_code == 400 and "--disable-runtime-lora" in r.json()["error"]["message"]
    r = requests.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "good"})
    assert r.status_code in (400, 404) and "--disable-runtime-lora" in r.json()["error"]["message"]
    assert "good" in {m["id"] for m in requests.get(s.url + "/v1/models").json()["data"]}
