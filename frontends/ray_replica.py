"""The replica side of loraplex on Ray Serve (frontends/ray_app.py has the ingress and the application).

- `EngineReplica` (`replica_deployment`): one whole `loraplex serve` (engine + one HTTP frontend, its own
  pool) as a child process of the replica; requests reach it as (method, path, headers, body) and its
  answer streams back as bytes, a JSON head first. Its `@serve.multiplexed` loader is Ray Serve's record of
  which adapters live on it (the engine itself loads them on first use), bounded by
  `max_adapters_per_replica`. The child gets SIGTERM when the replica's process dies.
- `Directory`: where each replica's server listens, so that load / unload / models / health / metrics
  reach every replica; and what each replica's engine has charged its tenants' rate limits, which every
  replica hands its own engine twice a second (RATE_SYNC_S), so that a tenant's limits hold across replicas.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import aiohttp
from ray import serve
from ray.serve.handle import DeploymentHandle

from frontends import ready
from frontends.engine_client import AsyncEngineClient
from frontends.lifetime import die_with_parent

DRAIN_ACK_S = 10.0      # after Directory.drain(), how long a live replica may take to say it is draining
RATE_SYNC_S = 0.5       # how often each replica shares its engine's rate-limit charges (engine/serving/rate_limits.py)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Directory:
    """Replica name -> {"url", "pid", "model"} of the loraplex server it runs; and whether the launcher is
    stopping the application (a replica whose server has exited then is not replaced)."""

    def __init__(self):
        self.replicas: dict[str, dict] = {}
        self.runtime: dict[str, dict] = {}      # adapters loaded at run time: name -> its load request
        self.stopping = False
        self.draining = False                   # the replicas are to drain their servers themselves
        self.drain_at = 0.0                     # when (time.monotonic)
        self.acked: set[str] = set()            # replicas that have sent their server SIGTERM since
        self.drained: set[str] = set()          # replicas whose server has exited since
        # (replica, engine incarnation) -> its engine's rate-limit charges since it started, cumulative
        self.charges: dict[tuple[str, str], dict[str, dict[str, float]]] = {}

    def stop(self) -> None:
        self.stopping = True

    def is_stopping(self) -> bool:
        return self.stopping

    def drain(self) -> None:
        """The stop on a cluster not ours (the launcher cannot signal processes on its nodes): each replica
        sends its server SIGTERM at its next health check, says so, and reports once the server has exited."""
        self.stopping = self.draining = True
        self.drain_at = time.monotonic()

    def is_draining(self) -> bool:
        return self.draining

    def note_draining(self, name: str) -> None:
        self.acked.add(name)

    def note_drained(self, name: str) -> None:
        self.drained.add(name)

    def undrained(self) -> list[str]:
        """The registered replicas whose server has not exited since drain(). A replica that has not said it
        is draining DRAIN_ACK_S after drain() is taken for gone (one Ray Serve replaced, and no fan-out has
        found dead since): a live one answers at its next health check, every 2 s."""
        late = time.monotonic() - self.drain_at > DRAIN_ACK_S
        return sorted(n for n in self.replicas if n not in self.drained and (n in self.acked or not late))

    def register(self, name: str, info: dict) -> None:
        self.replicas[name] = info

    def note_load(self, name: str, request: dict) -> None:
        self.runtime[name] = request

    def note_unload(self, name: str) -> None:
        self.runtime.pop(name, None)

    def runtime_adapters(self) -> dict[str, dict]:
        return dict(self.runtime)

    def forget(self, name: str) -> None:
        self.replicas.pop(name, None)

    def all(self) -> dict[str, dict]:
        return dict(self.replicas)

    def exchange_charges(self, name: str, incarnation: str, charged: dict[str, dict[str, float]]) -> dict:
        """A replica's engine's rate-limit charges ({tenant: {limit: units}}, cumulative since it started) ->
        every other engine's, summed: the other replicas', and those of engines and replicas gone since (what
        they admitted still counts against the minute)."""
        self.charges[(name, incarnation)] = charged
        others: dict[str, dict[str, float]] = {}
        for key, table in self.charges.items():
            if key == (name, incarnation):
                continue
            for tenant, by in table.items():
                theirs = others.setdefault(tenant, {})
                for limit, units in by.items():
                    theirs[limit] = theirs.get(limit, 0.0) + units
        return others


class _Replica:
    """One loraplex server per replica (see the module doc). Subclassed by `replica_deployment` to fix
    Ray Serve's per-replica adapter bound."""

    async def __init__(self, serve_args: list[str], directory: DeploymentHandle, ingress_key: str | None = None):
        """ingress_key: the key the ingress polls this replica's /metrics with (envs.ingress_metrics_key)."""
        self.name = serve.get_replica_context().replica_id.unique_id
        self.draining = False
        host = os.environ.get("LORAPLEX_REPLICA_HOST", "127.0.0.1")
        env = dict(os.environ, **({"LORAPLEX_INGRESS_METRICS_KEY": ingress_key} if ingress_key else {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--host", host, "--port", "0",
                                      "--frontends", "1", *serve_args], stdout=subprocess.PIPE, env=env,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent())
        info = await asyncio.get_running_loop().run_in_executor(None, self._wait_ready)
        self.url, self.model = info["url"], info["model"]
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.directory = directory
        await self._restore(info["engine_address"], await directory.runtime_adapters.remote())
        pids = [self.proc.pid, info["engine_pid"], *info["frontend_pids"]]    # what must be gone at the end
        await directory.register.remote(self.name, {"url": self.url, "pid": os.getpid(), "model": self.model,
                                                    "pids": pids})
        self._rates = asyncio.get_running_loop().create_task(self._share_rates(info["engine_address"]))

    async def _share_rates(self, engine_address: str) -> None:
        """Every RATE_SYNC_S: this replica's engine's rate-limit charges to the Directory, and the other engines'
        back to it at once (engine/serving/rate_limits.py); a charge reaches the other engines within two
        such rounds. A failed exchange (the engine restarting, the Directory replaced) is tried again at the
        next one; the figures are cumulative, so none is lost."""
        client, failing = None, False
        while True:
            await asyncio.sleep(RATE_SYNC_S)
            try:
                if client is None:
                    client = await AsyncEngineClient(engine_address, f"replica-{self.name}-rates").connect(timeout=60)
                mine = await client.rate_sync(None)
                others = await self.directory.exchange_charges.remote(self.name, mine.incarnation, mine.charged)
                await client.rate_sync(others)
                failing = False
            except Exception as e:  # noqa: BLE001 - a replica keeps serving; the next exchange catches up
                if not failing and self.proc.poll() is None:
                    print(f"loraplex replica {self.name}: rate limits not shared this time: {e}", flush=True)
                failing = True

    async def _restore(self, engine_address: str, adapters: dict[str, dict]) -> None:
        """Before this replica serves: the adapters loaded at run time through the application (a replica
        started later, e.g. replacing a dead one, has them as the others do), straight to its engine (the
        same path rules as the load route). One that fails is logged, and the replica serves the rest."""
        if not adapters:
            return
        client = await AsyncEngineClient(engine_address, f"replica-{self.name}").connect(timeout=60)
        try:
            for name, req in adapters.items():
                try:
                    await client.load_adapter(name, req.get("lora_path") or "", bool(req.get("pinned")))
                    print(f"loraplex replica {self.name}: restored runtime adapter {name!r}", flush=True)
                except Exception as e:  # noqa: BLE001 - one adapter must not keep the replica down
                    print(f"loraplex replica {self.name}: runtime adapter {name!r} not restored: {e}", flush=True)
        finally:
            await client.close()

    def _wait_ready(self) -> dict:
        """The server's ready line (frontends/ready.py); its other output goes to the replica's log."""
        try:
            info = ready.wait_for(self.proc.stdout, lambda line: print(line, end="", flush=True))
        except RuntimeError:
            raise RuntimeError("the replica's loraplex server did not start") from None
        threading.Thread(target=self._drain, daemon=True).start()
        return info

    def _drain(self) -> None:
        for line in self.proc.stdout:
            print(line, end="", flush=True)

    async def adapter(self, name: str) -> str:       # decorated with serve.multiplexed in replica_deployment
        return name

    async def __call__(self, method: str, path: str, headers: dict, body: bytes):
        """Forward one request to this replica's server; yield a JSON head (status, headers, replica),
        then the body as it comes."""
        model = serve.get_multiplexed_model_id()
        if model:
            await self.adapter(model)
        async with self.session.request(method, self.url + path, headers=headers, data=body) as r:
            head = {"status": r.status, "replica": self.name,
                    "headers": {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "retry-after")}}
            yield json.dumps(head).encode()
            async for chunk in r.content.iter_any():
                yield chunk

    async def check_health(self) -> None:
        """Fails once the server has exited (Ray Serve then replaces the replica), except while the launcher
        stops the application: a SIGTERM to every process of the service (systemd's stop of its cgroup)
        reaches the servers too, and each drains and exits on its own; a replacement started then would
        only be killed again. On a cluster not the launcher's (Directory.drain), the replica itself sends
        its server SIGTERM, and says when it has drained and exited."""
        if self.proc.poll() is None:
            if not self.draining and await self.directory.is_draining.remote():
                self.draining = True
                print(f"loraplex replica {self.name}: draining its server", flush=True)
                self.proc.terminate()
                await self.directory.note_draining.remote(self.name)
            return
        if self.draining or await self.directory.is_stopping.remote():
            await self.directory.note_drained.remote(self.name)
            return
        raise RuntimeError(f"the replica's loraplex server exited with {self.proc.returncode}")

    def __del__(self):
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()


def replica_deployment(max_adapters: int, gpus: float = 0, drain_s: float = 30.0):
    """The replica deployment with Ray Serve's bound on adapters per replica. The replica's own process
    takes no CPU in Ray's accounting (its server's processes do the work); `gpus`: GPUs per replica;
    `drain_s`: how long Ray Serve lets a replica it stops (a deletion, a scale-down, a redeploy) finish its
    running requests, its server's --shutdown-timeout (Ray's own default is 20 s)."""
    class EngineReplica(_Replica):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def adapter(self, name: str) -> str:
            return name
    return serve.deployment(name="EngineReplica", max_ongoing_requests=256, health_check_period_s=2,
                            health_check_timeout_s=30, graceful_shutdown_timeout_s=drain_s,
                            ray_actor_options={"num_cpus": 0, "num_gpus": gpus})(EngineReplica)
