"""`loraplex serve --replicas N`: the Ray Serve application of frontends/ray_app.py on a local Ray instance
(or the cluster at --ray-address), until SIGINT / SIGTERM."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from frontends.argv import drop_flags

# flags of `loraplex serve` that belong to the whole application, not to each replica's server
APP_FLAGS = {"--replicas", "--ray-address", "--max-adapters-per-replica", "--host", "--port", "--frontends",
             "--replica-routing", "--replica-load-bound"}
# the records of --enable-log-requests (frontends/request_log.py), which Ray must pass on whole
REQUEST_RECORD = r'\{"request_id":'


def keep_request_records() -> None:
    """Ray's driver folds log lines of its workers that look alike (ids and numbers aside) into one line
    "[repeated Nx across cluster]", which dropped whole records of the replicas' request logs. Exempt them
    (RAY_DEDUP_LOGS_ALLOW_REGEX, beside any the user set; read when ray is first imported)."""
    own = os.environ.get("RAY_DEDUP_LOGS_ALLOW_REGEX")
    os.environ["RAY_DEDUP_LOGS_ALLOW_REGEX"] = f"(?:{own})|{REQUEST_RECORD}" if own else REQUEST_RECORD


def replica_argv(argv: list[str]) -> list[str]:
    """The `serve` arguments each replica's server gets: the application's own flags removed, paths made
    absolute (replicas may run in another directory)."""
    out = [os.path.abspath(a) if not a.startswith("-") and os.path.exists(a) else a
           for a in drop_flags(argv, APP_FLAGS)]
    return [a for a in out if a != "serve"] + ["--replicas", "1"]      # also if a --config file says otherwise


def serve_on_ray(argv: list[str], replicas: int, max_adapters: int, host: str, port: int,
                 ray_address: str | None, routing: str = "adapter", load_bound: float = 0.0,
                 shutdown_timeout: float = 30.0) -> int:
    """Serve until SIGINT / SIGTERM; return only once every replica's processes are gone (each replica's
    server drains for up to `shutdown_timeout`, its --shutdown-timeout, before the launcher kills it)."""
    import sys
    keep_request_records()

    import ray
    from ray import serve

    from frontends import ready
    from frontends.launcher import free_port
    from frontends.lifetime import port_holder
    from frontends.ray_app import build_app
    if port and (holder := port_holder(host, port)):
        print(f"loraplex: error: {host}:{port} is already served by {holder}; stop it or choose another --port",
              file=sys.stderr, flush=True)
        return 1
    if ray_address and (why := unreachable(ray_address)):
        print(f"loraplex: error: --ray-address {ray_address}: {why}", file=sys.stderr, flush=True)
        return 1
    try:
        start_ray(ray_address)
    except ConnectionError as e:
        print(f"loraplex: error: --ray-address {ray_address}: {e}{auth_hint()}", file=sys.stderr, flush=True)
        return 1
    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    gcs = None if ray_address else local_gcs(os.getpid())
    pids: dict[int, str] = {}      # every replica server's process seen, with its start time (pids are reused)
    directory = None

    def note_pids(timeout: float = 30.0) -> None:
        if gcs is not None:     # a cluster's replicas may run on other machines: their pids mean nothing here
            _note_pids(directory, pids, timeout)
    try:
        app = build_app(replica_argv(argv), replicas, max_adapters, routing=routing, load_bound=load_bound)
        serve.run(app, name="loraplex", route_prefix="/")
        directory = serve.get_deployment_handle("Directory", app_name="loraplex")
        note_pids()                         # before ready: a stop right after it must know every replica's server
        where = ray_address or "a local Ray instance"
        url = f"http://{host}:{port}"
        print(f"loraplex: serving at {url}/v1 ({replicas} replicas on Ray Serve, {where})", file=sys.stderr,
              flush=True)
        ready.announce(url=url, replicas=replicas, pid=os.getpid())
        while not stopping.wait(1.0):       # the replicas' processes, replacements and replaced ones included
            note_pids()
        with contextlib.suppress(Exception):   # no replica is replaced from here on (ray_replica.check_health)
            directory.stop.remote().result(timeout_s=5.0)
        note_pids(5.0)                      # a replica registered since the last look (a replacement, say)
    finally:
        if gcs is not None and stopping.is_set():
            _stop_local(pids, stop_wait_s(shutdown_timeout))
        if gcs is None and directory is not None:
            _drain_remote(directory, stop_wait_s(shutdown_timeout))
        for stop in (serve.shutdown if gcs is not None else _leave_serve, ray.shutdown):
            pids.update(descendants(os.getpid()))      # a local Ray's processes (workers, agents) are ours
            with contextlib.suppress(Exception):
                stop()
        wait = stop_wait_s(shutdown_timeout)
        left = wait_gone([p for p, started in pids.items() if _start_time(p) == started], wait)
        if left:
            print(f"loraplex: processes {left} still ran {wait:.0f} s after the stop; killed", flush=True)
        print("loraplex: stopped", flush=True)
    return 0


def unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why no Ray cluster can answer at a plain `host:port` address (nothing listens, no such host), or None
    (reachable, or another form: `auto`, `ray://...`, which ray.init judges). ray.init itself retries an
    address where nothing listens for minutes before it gives up."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as e:
        return f"no Ray cluster answers there ({e.strerror or e})"


def auth_hint() -> str:
    """What to check when a reachable cluster refused this process: Ray 2.59 and later start clusters with
    token authentication, and a client without the token gets only a connection error."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return " (RAY_AUTH_MODE=token is set: is the token, RAY_AUTH_TOKEN or its file, the cluster's?)"
    return (" (if the cluster uses token authentication, as `ray start` does from Ray 2.59 on, set RAY_AUTH_MODE=token"
            " and the cluster's token, RAY_AUTH_TOKEN or `ray get-auth-token` on its head, in this environment)")


def start_ray(ray_address: str | None) -> None:
    """ray.init, with SIGTERM blocked in the processes a local instance starts (its GCS, raylet and, through
    the raylet, every worker: Serve's proxy, the ingress and the replicas' actors). A SIGTERM to the whole
    process group (`kill -- -PGID`; systemd's cgroup-wide stop) then stops only this launcher, which drains
    the replicas' servers while Ray's proxy still carries their streams, then kills Ray's processes
    (_stop_local). Ray itself already blocks SIGINT there. A replica's server unblocks SIGTERM
    (lifetime.die_with_parent). The mask is this thread's, restored once the processes are started."""
    import ray
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


ENGINE_STOP_S = 60.0    # beyond its --shutdown-timeout, what a replica's server may take to stop its engine


def stop_wait_s(shutdown_timeout: float) -> float:
    """How long the launcher waits for the replicas' servers after a stop before it kills them: their drain
    (--shutdown-timeout, passed to every replica) and their engines' stop."""
    return shutdown_timeout + ENGINE_STOP_S


RAY_STOP_S = 1.0        # then a local Ray's own processes are SIGKILLed: the wait for them to be gone


def local_gcs(root: int) -> int | None:
    """The pid of the GCS server of the Ray instance `root` started (ray.init without an address), if any."""
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"gcs_server"):
                return pid
    return None


def _stop_local(pids: dict[int, str], stop_wait: float) -> None:
    """The stop of a local Ray instance (ours: every process of it is below this one). Each replica's server
    gets SIGTERM, its launcher only (which drains its frontends, then stops its engine: after a stop of the
    whole cgroup the engine has had one SIGTERM already, and a second stops it at once), and drains its
    streams while Ray's proxy still carries them; then Ray's processes are SIGKILLed (they have SIGTERM
    blocked: start_ray). Not through `serve.shutdown()` nor Ray's exit hooks (before the mask, a group
    SIGTERM killed the GCS and `serve.shutdown()` then waited out its 30 s): it leaves with os._exit. A
    replica registered after the last reading of the pids gets SIGTERM from its Ray worker's death instead
    (frontends/lifetime.py), too late to drain through the proxy."""
    import sys
    servers = [p for p, started in pids.items() if _start_time(p) == started]
    for p in servers:
        if _parent(p) not in servers:        # each server's own launcher, which drains its frontends, then
            with contextlib.suppress(OSError):   # stops its engine: a second SIGTERM stops an engine at once
                os.kill(p, signal.SIGTERM)
    left = wait_gone(servers, stop_wait)
    ray_own = descendants(os.getpid())
    for p in ray_own:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)           # SIGTERM is blocked there (start_ray)
    wait_gone([p for p, started in ray_own.items() if _start_time(p) == started] + left, RAY_STOP_S)
    if left:
        print(f"loraplex: processes {left} still ran {stop_wait:.0f} s after the stop; killed", flush=True)
    print("loraplex: stopped", flush=True)
    sys.stderr.flush()
    os._exit(0)


def _drain_remote(directory, wait: float) -> None:
    """The stop on a cluster not ours (--ray-address): the launcher may run on another machine than the
    replicas, so each replica sends its own server SIGTERM (Directory.drain, ray_replica.check_health); the
    servers drain their streams while Ray Serve's proxy still carries them. Returns once every replica has
    reported its server gone, or after `wait` s."""
    import time
    with contextlib.suppress(Exception):
        directory.drain.remote().result(timeout_s=5.0)
        deadline, left = time.monotonic() + wait, ["?"]
        while time.monotonic() < deadline:
            left = directory.undrained.remote().result(timeout_s=5.0)
            if not left:
                return
            time.sleep(0.5)
        print(f"loraplex: replicas {left} still draining {wait:.0f} s after the stop; deleting the application",
              flush=True)


def _leave_serve() -> None:
    """On a cluster not ours: delete this application only (Ray Serve may run others there); Serve itself is
    shut down only when no application is left."""
    from ray import serve
    serve.delete("loraplex")
    if not serve.status().applications:
        serve.shutdown()


def _note_pids(directory, pids: dict[int, str], timeout: float = 30.0) -> None:
    """Add to `pids` (pid -> start time) the server processes of every replica the Directory knows now."""
    with contextlib.suppress(Exception):
        for info in directory.all.remote().result(timeout_s=timeout).values():
            for p in info.get("pids", []):
                if p not in pids and (started := _start_time(p)) is not None:
                    pids[p] = started


def descendants(root: int) -> dict[int, str]:
    """Every running process below `root` (children, theirs, ...) -> {pid: start time}."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        p = todo.pop()
        if (started := _start_time(p)) is not None and _alive(p):
            out[p] = started
        todo += children.get(p, [])
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` runs (SIGKILL those left after `timeout` s) -> the pids that had to be killed."""
    import time
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for p in alive:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return alive


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), or None if it does not run: a pid with another start
    time is another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
