"""`loraplex serve --replicas N`: the Ray Serve application of frontends/ray_app.py on a local Ray instance
(or the cluster at --ray-address), until SIGINT / SIGTERM."""
from __future__ import annotations

import os
import signal
import threading

# flags of `loraplex serve` that belong to the whole application, not to each replica's server
APP_FLAGS = {"--replicas", "--ray-address", "--max-adapters-per-replica", "--host", "--port", "--frontends",
             "--replica-routing", "--replica-load-bound"}


def replica_argv(argv: list[str]) -> list[str]:
    """The `serve` arguments each replica's server gets: the application's own flags removed, paths made
    absolute (replicas may run in another directory)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in APP_FLAGS:
            skip = "=" not in a
            continue
        out.append(os.path.abspath(a) if not a.startswith("-") and os.path.exists(a) else a)
    return [a for a in out if a != "serve"] + ["--replicas", "1"]      # also if a --config file says otherwise


def serve_on_ray(argv: list[str], replicas: int, max_adapters: int, host: str, port: int,
                 ray_address: str | None, routing: str = "adapter", load_bound: float = 0.0) -> int:
    import ray
    from ray import serve

    from frontends.launcher import free_port
    from frontends.ray_app import build_app
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        app = build_app(replica_argv(argv), replicas, max_adapters, routing=routing, load_bound=load_bound)
        serve.run(app, name="loraplex", route_prefix="/")
        where = ray_address or "a local Ray instance"
        print(f"loraplex: serving at http://{host}:{port}/v1 ({replicas} replicas on Ray Serve, {where})", flush=True)
        stopping.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
        print("loraplex: stopped", flush=True)
    return 0
