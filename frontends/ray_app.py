"""loraplex replicas on Ray Serve: each request goes to where its adapter lives.

Three deployments (needs the optional extra: `pip install loraplex[ray]`):
- `EngineReplica` (N of them) and `Directory` (1), in frontends/ray_replica.py: each replica runs one whole
  `loraplex serve` with its own pool; its `@serve.multiplexed` loader is Ray Serve's record of which
  adapters live on it, so the router sends an adapter's requests to a replica that holds it while it has
  room (`max_adapters_per_replica`). The directory knows where each replica's server listens, so that
  load / unload / models / health / metrics reach every replica.
- `Ingress` (1, the HTTP entry): the same OpenAI API as one server. Completions and chat go through the
  replica handle with `multiplexed_model_id` = the adapter (base-model requests without one: Ray's router
  picks the less loaded of two replicas). Optionally affinity is bounded by load (`load_bound` > 0): when
  the replica that serves an adapter runs or queues more than `load_bound` times the replicas' mean (plus
  one), its next requests go without the id, to the less loaded of two, which loads the adapter too (a
  hot adapter spreads instead of piling onto one replica); loads are polled from the replicas' /metrics
  every POLL_S seconds. A replica that fails before its answer is complete is tried once more, after
  that a 503 (a non-streamed answer is collected whole before it is sent, so it is never cut short); a
  stream cut by a dead replica ends with an error event. Every response carries
  `x-loraplex-replica`, and the request's `X-Request-Id` (the caller's, or one Ray Serve's proxy made;
  the replicas get it too). Validation, tenants and keys are each replica's own (the same config everywhere).

`build_app(serve_args, replicas, max_adapters)` makes the application; `app_builder` is the same for
`serve run frontends.ray_app:app_builder replicas=2 serve_args="--model DIR ..."` or a Serve config file.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets

import aiohttp
import msgspec
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontends.api_responses import Model, ModelList, StatusReply, encode, error
from frontends.ray_replica import Directory, replica_deployment
from frontends.request_id import HEADER as REQUEST_ID
from frontends.request_id import request_id

GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
BROADCAST = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
HEADER = "x-loraplex-replica"
log = logging.getLogger("loraplex.ray")
LOAD_BOUND = 0.0      # > 0: affinity holds while a replica carries at most this x the mean load (+ 1)
POLL_S = 0.5          # how often the ingress reads the replicas' loads
POLL_TIMEOUT_S = 2.0  # a replica whose /metrics takes longer is left out of that poll


UNAVAILABLE = "replica_unavailable"   # the error code of a replica that could not be reached (and was forgotten)


def _error(status: int, message: str, code: str | None = None) -> bytes:
    return encode(error(status, message, code=code))


def _json(body: bytes, status: int = 200, headers: dict | None = None) -> Response:
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")[:200]


def _unreachable(data: bytes) -> bool:
    try:
        return json.loads(data)["error"]["code"] == UNAVAILABLE
    except (ValueError, KeyError, TypeError):
        return False


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, replicas: DeploymentHandle, directory: DeploymentHandle, routing: str = "adapter",
                 load_bound: float = LOAD_BOUND, poll_key: str | None = None):
        """poll_key: the key the replicas let read /metrics for the load poll (whatever keys they have)."""
        self.replicas, self.directory, self.routing, self.load_bound = replicas, directory, routing, load_bound
        self.poll_headers = {"Authorization": f"Bearer {poll_key}"} if poll_key else {}
        self.session: aiohttp.ClientSession | None = None
        self.base: set[str] = set()         # the base model's name(s): requests for it carry no adapter
        self.where: dict[str, str] = {}     # adapter -> the replica that served its last affinity-routed request
        self.load: dict[str, float] = {}    # replica -> requests running + waiting (polled)
        self.poller: asyncio.Task | None = None

    async def __call__(self, request: Request) -> Response:
        """The request's X-Request-Id goes to the replicas (frontends/request_id.py): Ray Serve's proxy gives a
        request without one its own, and puts it on the answer; one the replicas would refuse is a 400 here."""
        try:
            rid = request_id(request.headers.get(REQUEST_ID))
        except ValueError as e:
            return _json(_error(400, str(e), "invalid_request_id"), 400)
        return await self.route(request, rid)

    async def route(self, request: Request, rid: str) -> Response:
        body, path = await request.body(), request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        headers[REQUEST_ID] = rid
        if request.method == "POST" and path in GENERATE:
            return await self.generate(request.method, path, headers, body)
        if request.method == "POST" and path in BROADCAST:
            return await self.everywhere(request.method, path, headers, body)
        if path == "/v1/models":
            return await self.models(headers)
        if path == "/health":
            return await self.health()
        if path == "/metrics":
            return await self.metrics(headers)
        return await self.forward(request.method, path, headers, body, "")

    # -- generation: one replica, chosen by adapter -------------------------------------------------------
    async def generate(self, method: str, path: str, headers: dict, body: bytes) -> Response:
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None                       # the replica answers with the 400 that names the problem
        if not self.base:
            self.base = {info["model"] for info in (await self.directory.all.remote()).values()}
        adapter = model if isinstance(model, str) and model and model not in self.base else ""
        if self.routing == "random":
            adapter = ""                # for comparison: Ray's router alone, blind to adapters
        if adapter and self.load_bound:
            if self.poller is None:
                self.poller = asyncio.create_task(self._poll_loads())
            if self.overloaded(self.where.get(adapter)):
                return await self.forward(method, path, headers, body, "")
        return await self.forward(method, path, headers, body, adapter)

    def overloaded(self, replica: str | None) -> bool:
        """Whether `replica` carries more than load_bound x the mean load (+ 1) of the replicas."""
        if replica is None or replica not in self.load:
            return False
        mean = sum(self.load.values()) / len(self.load)
        return self.load[replica] > self.load_bound * mean + 1

    async def _poll_loads(self) -> None:
        while True:
            try:
                answers = await self._each("GET", "/metrics", self.poll_headers, None, forget=False,
                                           timeout=POLL_TIMEOUT_S)
                self.load = {name: replica_load(raw.decode()) for name, status, raw in answers if status == 200}
                if any(status in (401, 403) for _, status, _ in answers):
                    log.warning("ingress: a replica refused the load poll's key: its load is unknown")
            except Exception:  # noqa: BLE001 - a slow or failing poll must not end the polling
                log.warning("ingress: reading the replicas' loads failed", exc_info=True)
            await asyncio.sleep(POLL_S)

    async def forward(self, method: str, path: str, headers: dict, body: bytes, adapter: str) -> Response:
        for attempt in range(2):
            gen = self.replicas.options(multiplexed_model_id=adapter, stream=True).remote(method, path, headers, body)
            try:
                head = json.loads(await gen.__anext__())
                out_headers = {**head["headers"], HEADER: head["replica"]}
                self._routed(adapter, head["replica"])
                if not head["headers"].get("Content-Type", "").startswith("text/event-stream"):
                    whole = b"".join([chunk async for chunk in gen])
                    return Response(whole, status_code=head["status"], headers=out_headers)
            except Exception:  # noqa: BLE001 - a replica that died or failed before its answer was whole: once more
                if attempt == 1:
                    return _json(_error(503, "no replica could serve this request"), 503)
                await asyncio.sleep(0.2)
                continue
            return StreamingResponse(self._rest(gen, head), status_code=head["status"], headers=out_headers)

    def _routed(self, adapter: str, replica: str) -> None:
        """Remember where an adapter's affinity lies (the replica Ray's multiplexing sent it to)."""
        if adapter:
            self.where[adapter] = replica

    @staticmethod
    async def _rest(gen, head: dict):
        try:
            async for chunk in gen:
                yield chunk
        except Exception:  # noqa: BLE001 - the replica died mid-answer: say so, in the stream's own terms
            if head["headers"].get("Content-Type", "").startswith("text/event-stream"):
                yield b"data: " + _error(503, "the replica serving this stream failed") + b"\n\n"

    # -- every replica --------------------------------------------------------------------------------------
    async def _each(self, method: str, path: str, headers: dict, body: bytes | None, forget: bool = True,
                    timeout: float | None = None, only: set[str] | None = None) -> list[tuple[str, int, bytes]]:
        """Ask every replica in the Directory; one that cannot be reached answers 503 and, with `forget`,
        is dropped from the Directory (Ray Serve replaces a dead replica; the new one registers itself).
        The load poller does not forget: a poll that fails once must not drop a live replica. A replica
        that does not answer within `timeout` seconds (the session's 300 s if None) answers 503."""
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        replicas = await self.directory.all.remote()
        if only is not None:
            replicas = {n: info for n, info in replicas.items() if n in only}

        limit = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}

        async def one(name: str, url: str):
            try:
                async with self.session.request(method, url + path, headers=headers, data=body, **limit) as r:
                    return name, r.status, await r.read()
            except asyncio.TimeoutError:        # slow, not gone: never forgotten for it
                return name, 503, _error(503, f"replica {name} did not answer in time")
            except aiohttp.ClientError:
                if forget:
                    await self.directory.forget.remote(name)  # gone (replaced by Ray Serve): forget it
                return name, 503, _error(503, f"replica {name} is unavailable", UNAVAILABLE)
        return list(await asyncio.gather(*(one(n, info["url"]) for n, info in replicas.items())))

    async def everywhere(self, method: str, path: str, headers: dict, body: bytes) -> Response:
        """Load / unload on every replica, all or nothing. A load refused by a replica is undone on those that
        took it, and the answer names the replica and its reason; an unload is done where it can be and a
        replica that refuses is named. Done, it is noted in the Directory, whose runtime set a replica
        that Ray Serve starts later (a replacement) loads before it serves. A replica that cannot be
        reached is forgotten (its replacement gets the set), not counted as refusing."""
        answers = await self._each(method, path, headers, body)
        if not answers:
            return _json(_error(503, "no replica is up"), 503)
        load = path == BROADCAST[0]
        took = [a for a in answers if a[1] == 200]
        refused = [a for a in answers if a[1] != 200 and not _unreachable(a[2])
                   and not (not load and a[1] == 404)]               # unloading what a replica lacks: done
        reached = [a for a in answers if not _unreachable(a[2])]
        if not reached:
            return Response(answers[0][2], status_code=503, media_type="application/json")
        req = json.loads(body)
        if refused:
            name, status, data = refused[0]
            msg = f"replica {name} refused it: {_message(data)}"
            if load and took:
                undo = json.dumps({"lora_name": req["lora_name"]}).encode()
                await self._each("POST", BROADCAST[1], headers, undo, only={a[0] for a in took})
                msg += f"; undone on {', '.join(a[0] for a in took)}"
            elif not load and took:
                msg += f"; unloaded on {', '.join(a[0] for a in took)} (unload again to retry)"
            log.warning("%s %s: %s", path, req.get("lora_name"), msg)
            return _json(_error(status, msg), status, {HEADER: ",".join(a[0] for a in took)})
        if load:
            await self.directory.note_load.remote(req["lora_name"], req)
        else:
            await self.directory.note_unload.remote(req["lora_name"])
        name, status, data = took[0] if took else reached[0]
        return Response(data, status_code=200, media_type="application/json",
                        headers={HEADER: ",".join(a[0] for a in reached)})

    async def models(self, headers: dict) -> Response:
        answers = await self._each("GET", "/v1/models", headers, None)
        ok = [a for a in answers if a[1] == 200]
        if not ok:
            name, status, data = answers[0] if answers else ("", 503, _error(503, "no replica"))
            return Response(data, status_code=status, media_type="application/json")
        seen: dict[str, Model] = {}       # id -> its entry, with the replicas that list it
        for name, _, raw in ok:
            for m in msgspec.json.decode(raw, type=ModelList).data:
                seen.setdefault(m.id, msgspec.structs.replace(m, replicas=[])).replicas.append(name)
        return _json(encode(ModelList(object="list", data=list(seen.values()))),
                     headers={HEADER: ",".join(a[0] for a in ok)})

    async def health(self) -> Response:
        answers = await self._each("GET", "/health", {}, None)
        up = [a[0] for a in answers if a[1] == 200]
        status = 200 if answers and len(up) == len(answers) else 503
        reply = StatusReply(status="ok" if status == 200 else "degraded", replicas=len(answers), up=len(up))
        return _json(encode(reply), status, {HEADER: ",".join(up)})

    async def metrics(self, headers: dict) -> Response:
        """Each replica's Prometheus text, every sample labelled with its replica. The caller's key goes to
        the replicas, which decide (an admin or metrics key when keys are configured): refused by all, the
        refusal is the answer."""
        out, refused = [], None
        for name, status, raw in await self._each("GET", "/metrics", headers, None):
            if status in (401, 403):
                refused = (status, raw)
            if status != 200:
                continue
            for line in raw.decode().splitlines():
                if line.startswith("#") or not line:
                    continue
                metric, _, value = line.rpartition(" ")
                label = f'replica="{name}"'
                metric = metric[:-1] + "," + label + "}" if metric.endswith("}") else metric + "{" + label + "}"
                out.append(f"{metric} {value}")
        if not out and refused is not None:
            return Response(refused[1], status_code=refused[0], media_type="application/json")
        return Response("\n".join(out) + "\n", media_type="text/plain; version=0.0.4")


def replica_load(metrics_text: str) -> float:
    """Requests running + waiting in a replica's engine, from its Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("loraplex_requests_running", "loraplex_requests_waiting"):
            total += float(value)
    return total


def build_app(serve_args: list[str], replicas: int, max_adapters: int = 64, gpus_per_replica: float = 0,
              routing: str = "adapter", load_bound: float = LOAD_BOUND):
    """The application: `replicas` engine replicas, each `loraplex serve <serve_args>`. routing "random":
    ignore adapters (Ray's default router: the less loaded of two random replicas), for comparison;
    load_bound: see Ingress (0: affinity whatever the load). The ingress polls the replicas' loads with a
    key made here, which each replica's server lets read /metrics and nothing else."""
    from frontends.cli import serve_setting
    poll_key = "sk-ingress-" + secrets.token_urlsafe(24)
    directory = Directory.bind()
    drain_s = serve_setting(serve_args, "shutdown_timeout")
    engines = replica_deployment(max_adapters, gpus_per_replica, drain_s).options(num_replicas=replicas).bind(
        serve_args, directory, poll_key)
    return Ingress.bind(engines, directory, routing, load_bound, poll_key)


def app_builder(args: dict):
    """For `serve run frontends.ray_app:app_builder replicas=2 serve_args="--model DIR ..."` and Serve
    config files (`applications[].import_path` with `args`)."""
    import shlex
    serve_args = args.get("serve_args", "")
    serve_args = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args)
    return build_app(serve_args, int(args.get("replicas", 2)), int(args.get("max_adapters_per_replica", 64)),
                     float(args.get("gpus_per_replica", 0)), args.get("routing", "adapter"),
                     float(args.get("load_bound", LOAD_BOUND)))
