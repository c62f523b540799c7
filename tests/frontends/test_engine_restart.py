"""The client resends in-flight requests to a restarted engine: a scripted engine on a ZMQ ROUTER socket."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from frontends import engine_client
from frontends.engine_client import AsyncEngineClient, EngineError
from ipc.outputs import EngineStatus, RequestOutput, encode_outputs
from ipc.requests import GenerateRequest, Hello, decode_request
from ipc.sampling_params import SamplingParams


class ScriptedEngine:
    def __init__(self):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.incarnation = "first"
        self.client: bytes | None = None
        self.requests: asyncio.Queue = asyncio.Queue()
        self.down = False             # drops everything, as a dead engine would
        self._task = asyncio.create_task(self._serve())

    async def _serve(self):
        while True:
            ident, data = await self.sock.recv_multipart()
            if self.down:
                continue
            self.client = ident
            msg = decode_request(data)
            if isinstance(msg, Hello):
                await self.status()
            elif isinstance(msg, GenerateRequest):
                self.requests.put_nowait(msg)

    async def status(self):
        await self.send(EngineStatus("m", "/m", 2048, [], incarnation=self.incarnation))

    async def send(self, *msgs):
        await self.sock.send_multipart([self.client, encode_outputs(list(msgs))])

    async def restart(self):
        self.incarnation += "+"
        await self.status()

    def close(self):
        self._task.cancel()
        self.sock.close(0)
        self.ctx.term()


async def _collect(gen, into: list):
    async for out in gen:
        into.append(out)


@pytest.mark.asyncio
async def test_in_flight_request_is_resent_as_prompt_plus_tokens_so_far():
    engine = ScriptedEngine()
    client = await AsyncEngineClient(engine.address).connect(timeout=10)
    outs: list[RequestOutput] = []
    params = SamplingParams(temperature=0, max_tokens=5, seed=3)
    task = asyncio.create_task(_collect(client.generate([1, 2, 3], params, adapter="a", cache_salt="s"), outs))
    first = await asyncio.wait_for(engine.requests.get(), 5)
    assert first.prompt_token_ids == [1, 2, 3] and first.params.max_tokens == 5
    await engine.send(RequestOutput(first.request_id, [10, 11], "ab"))
    await asyncio.sleep(0.1)
    await engine.restart()
    again = await asyncio.wait_for(engine.requests.get(), 5)
    assert again.request_id == first.request_id
    assert again.prompt_token_ids == [1, 2, 3, 10, 11]
    assert again.params.max_tokens == 3 and again.params.seed == 3 and again.params.temperature == 0
    assert (again.adapter, again.cache_salt, again.stream) == ("a", "s", True)
    await engine.send(RequestOutput(again.request_id, [12, 13, 14], "cde", "length", prompt_tokens=5,
                                    completion_tokens=3))
    await asyncio.wait_for(task, 5)
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12, 13, 14]
    assert "".join(o.text for o in outs) == "abcde"
    assert (outs[-1].finish_reason, outs[-1].prompt_tokens, outs[-1].completion_tokens) == ("length", 3, 5)
    await client.close()
    engine.close()


@pytest.mark.asyncio
async def test_a_request_in_flight_at_a_second_restart_fails_with_503():
    engine = ScriptedEngine()
    client = await AsyncEngineClient(engine.address).connect(timeout=10)
    outs: list[RequestOutput] = []
    task = asyncio.create_task(_collect(client.generate([1], SamplingParams(max_tokens=8)), outs))
    req = await asyncio.wait_for(engine.requests.get(), 5)
    await engine.restart()
    assert (await asyncio.wait_for(engine.requests.get(), 5)).request_id == req.request_id
    await engine.restart()
    with pytest.raises(EngineError) as err:
        await asyncio.wait_for(task, 5)
    assert err.value.status == 503 and "twice" in str(err.value)
    assert engine.requests.empty()
    await client.close()
    engine.close()


@pytest.mark.asyncio
async def test_a_request_made_while_the_engine_is_down_waits_for_it(monkeypatch):
    monkeypatch.setattr(engine_client, "HEARTBEAT_TIMEOUT", 0.3)
    engine = ScriptedEngine()
    client = await AsyncEngineClient(engine.address).connect(timeout=10)
    engine.down = True
    while client.healthy:
        await asyncio.sleep(0.05)
    outs: list[RequestOutput] = []
    task = asyncio.create_task(_collect(client.generate([1, 2], SamplingParams(max_tokens=2)), outs))
    await asyncio.sleep(0.5)
    assert not task.done() and engine.requests.empty()        # waiting, not failed, not sent
    engine.down = False
    await engine.restart()
    req = await asyncio.wait_for(engine.requests.get(), 5)
    assert req.prompt_token_ids == [1, 2]
    await engine.send(RequestOutput(req.request_id, token_ids=[7, 8], finish_reason="length"))
    await asyncio.wait_for(task, 5)
    assert [o.token_ids for o in outs] == [[7, 8]]
    assert engine.requests.empty()                             # sent once
    await client.close()
    engine.close()


@pytest.mark.asyncio
async def test_an_engine_that_does_not_come_back_fails_the_request_with_503(monkeypatch):
    monkeypatch.setattr(engine_client, "HEARTBEAT_TIMEOUT", 0.3)
    monkeypatch.setattr(engine_client, "RESTART_WAIT", 1.0)
    engine = ScriptedEngine()
    client = await AsyncEngineClient(engine.address).connect(timeout=10)
    engine.down = True
    with pytest.raises(EngineError) as err:
        async for _ in client.generate([1], SamplingParams(max_tokens=2)):
            pass
    assert err.value.status == 503
    assert engine.requests.empty()
    await client.close()
    engine.close()
