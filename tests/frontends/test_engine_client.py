"""The ZMQ client library against the running engine process."""
import asyncio
import contextlib
import os
import time

import msgspec
import pytest
import requests

from frontends.engine_client import AsyncEngineClient, EngineClient, EngineError
from ipc.sampling_params import SamplingParams
from tests.frontends.conftest import API_KEY

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_blocking_client_generates_streams_and_manages_adapters(server, served_adapters, tokenizer):
    _, src = served_adapters
    c = EngineClient(server.engine_address)
    try:
        ids = tokenizer("The weather today is")["input_ids"]
        whole = c.generate(ids, GREEDY, adapter="r8-all")
        assert len(whole.token_ids) == 8 and whole.finish_reason == "length"
        pieces = list(c.stream(ids, GREEDY, adapter="r8-all"))
        assert "".join(p.text for p in pieces) == whole.text
        scored = c.generate(ids, msgspec.structs.replace(GREEDY, prompt_logprobs=1), adapter="r8-all")
        assert scored.token_ids == whole.token_ids and scored.prompt_logprobs[0] is None
        assert len(scored.prompt_logprobs) == len(ids) and all(e.logprob < 0 for e in scored.prompt_logprobs[1:])
        assert "via-client" in c.load_adapter("via-client", str(src / "r4-qv"))
        assert c.generate(ids, GREEDY, adapter="via-client").token_ids
        assert "via-client" not in c.unload_adapter("via-client")
        with pytest.raises(EngineError) as e:
            c.generate(ids, GREEDY, adapter="via-client")
        assert e.value.status == 404
        with pytest.raises(EngineError) as e:
            c.generate([], GREEDY)
        assert e.value.status == 400
    finally:
        c.close()


def test_async_client_abort_by_leaving_the_stream(server, tokenizer):
    async def main():
        c = await AsyncEngineClient(server.engine_address).connect()
        try:
            ids = tokenizer("Count to a thousand:")["input_ids"]
            params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
            n = 0
            async with contextlib.aclosing(c.generate(ids, params)) as gen:
                async for out in gen:
                    n += len(out.token_ids)
                    if n >= 3:
                        break                      # closing the generator aborts the request
            aborted_at = time.monotonic()
            for _ in range(100):
                if c.last_heartbeat > aborted_at and c.status.running == 0 and c.status.waiting == 0:
                    return True
                await asyncio.sleep(0.1)
            return False
        finally:
            await c.close()
    assert asyncio.run(main())


def test_cache_salt_isolates_prefix_reuse(server):
    prompt = "A long shared system prompt for every tenant of this platform. " * 8
    def cached(salt):
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        r = requests.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


async def test_a_connect_that_times_out_leaves_no_task_or_socket_behind():
    """No engine listens: the client gives up at its timeout with a 503, and its reader task and socket are
    gone (a replica retrying every half second must not pile them up)."""
    client = AsyncEngineClient(f"ipc:///tmp/loraplex-nobody-{os.getpid()}")
    before = asyncio.all_tasks()
    with pytest.raises(EngineError) as e:
        await client.connect(timeout=0.2)
    assert e.value.status == 503 and "did not answer" in str(e.value)
    await asyncio.sleep(0)                                # cancelled tasks finish
    assert asyncio.all_tasks() == before and client.sock.closed and client.ctx.closed
