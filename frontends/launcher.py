"""`loraplex serve`: start one engine process and N HTTP frontend processes on one port.

Processes are started with subprocess (never multiprocessing's pickling); each child prints one JSON
line on stdout when ready, and so does the launcher once all are (frontends/ready.py). Every child dies with
the launcher, however it dies (frontends/lifetime.py), and a port another server holds is refused. A
frontend that dies is restarted. A dead engine is restarted too; the
frontends reconnect by themselves and resend its in-flight requests (see frontends/engine_client.py).
SIGINT / SIGTERM shut every process down cleanly: the frontends first, each finishing its running requests
(up to --shutdown-timeout seconds) while the engine still serves them, then the engine. SIGHUP reads the
config file's [auth] table again (frontends/auth_reload.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from frontends import ready
from frontends.auth_reload import AuthFile
from frontends.lifetime import die_with_parent, port_holder

log = logging.getLogger("loraplex.serve")


def say(text: str, file=None, end: str = "\n") -> None:
    """print, flushed, that never raises: after a SIGHUP from a closed terminal the server goes on (reloading
    [auth]) with nowhere to write, and must not stop draining its children's output for that."""
    stream = file or sys.stdout
    try:
        print(text, file=stream, end=end, flush=True)
    except (OSError, ValueError):
        _gone(stream)


def _gone(stream) -> None:
    """A standard stream that no longer takes writes (its terminal hung up) is replaced by os.devnull, so that
    nothing written later fails, Python's own flush at exit included (it would turn exit status 0 into 120)."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is stream:
            setattr(sys, name, open(os.devnull, "w"))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    def __init__(self, name: str, argv: list[str], env: dict):
        self.name, self.argv, self.env = name, argv, env
        self.ready = threading.Event()
        self.info: dict = {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.ready.clear()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, preexec_fn=die_with_parent())
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        for line in self.proc.stdout:
            info = ready.parse(line)
            if info is not None:
                self.info = info
                self.ready.set()
            else:
                say(line, end="")        # drained even where the launcher's stdout is gone (a closed terminal)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill_if_alive(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(engine_kwargs: dict, adapter_dir: str | None, host: str, port: int, frontends: int,
          api_key: str | None, loading: dict | None = None, auth: dict | None = None,
          streaming: tuple[float, int] = (60.0, 1024), *, shutdown_timeout: float = 30.0,
          log_requests: bool = False, auth_source: Callable[[], dict | None] | None = None,
          chat_args: list[str] | None = None) -> int:
    """loading: {"lora_roots": [...], "runtime_lora": bool}, the runtime adapter loading rules; streaming:
    (--stream-timeout, --stream-buffer) of the frontends; shutdown_timeout: see `stop_all`; log_requests:
    the frontends' --enable-log-requests; auth_source: the config file's [auth] table as it is now, read again
    at SIGHUP (None: no config file); chat_args: the frontends' --tool-call-parser and --chat-template."""
    if port and (holder := port_holder(host, port)):
        print(f"loraplex: error: {host}:{port} is already served by {holder}; stop it or choose another --port",
              file=sys.stderr, flush=True)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="loraplex-"))       # removed at the end (see below)
    prom_dir = run_dir / "metrics"
    prom_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom_dir))
    if api_key:
        env["LORAPLEX_API_KEY"] = api_key
    auth_file = AuthFile(run_dir / "auth.json", auth_source, api_key)
    auth_file.write(auth)
    env["LORAPLEX_AUTH_FILE"] = str(auth_file.path)
    address = f"ipc://{run_dir}/engine.sock"
    port = port or free_port(host)
    py = sys.executable
    engine_argv = [py, "-m", "engine.serving.engine_proc", "--address", address,
                   "--engine-args", json.dumps(engine_kwargs), "--state-file", str(run_dir / "adapters.json"),
                   "--shutdown-timeout", str(shutdown_timeout)]
    if adapter_dir:
        engine_argv += ["--adapter-dir", adapter_dir]
    loading = loading or {}
    for root in loading.get("lora_roots", []):
        engine_argv += ["--lora-root", root]
    if not loading.get("runtime_lora", True):
        engine_argv.append("--disable-runtime-lora")
    if loading.get("max_waiting"):
        engine_argv += ["--max-waiting", str(loading["max_waiting"])]
    if loading.get("adapter_source"):
        engine_argv += ["--adapter-source", loading["adapter_source"]]
    engine = Child("engine", engine_argv, env)
    fronts = [Child(f"frontend-{i}", [py, "-m", "frontends.http_server", "--engine-address", address, "--host", host,
                                      "--port", str(port), "--frontend-id", f"http-{i}",
                                      "--stream-timeout", str(streaming[0]), "--stream-buffer", str(streaming[1]),
                                      "--shutdown-timeout", str(shutdown_timeout),
                                      *(["--enable-log-requests"] if log_requests else []), *(chat_args or [])],
                    env)
              for i in range(frontends)]
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    reload = threading.Event()
    if auth_source is not None:      # with a config file; without one, SIGHUP (a closed terminal) still stops it
        signal.signal(signal.SIGHUP, lambda *_: reload.set())
    try:
        engine.start()
        engine.wait_ready(900)
        for f in fronts:
            f.start()
        for f in fronts:
            f.wait_ready(300)
        url = f"http://{host}:{port}"
        model = engine.info.get("model", engine_kwargs.get("model"))
        say(f"loraplex: serving {model} at {url}/v1 ({frontends} frontend{'s' * (frontends != 1)}; engine pid "
            f"{engine.proc.pid} at {address})", file=sys.stderr)
        say(ready.line(url=url, model=model, engine_address=address, pid=os.getpid(), engine_pid=engine.proc.pid,
                       frontend_pids=[f.proc.pid for f in fronts]))
        while not stopping.wait(0.5):
            if reload.is_set():
                reload.clear()
                reload_auth(auth_file, fronts)
            if engine.proc.poll() is not None:
                say(f"loraplex: the engine exited with code {engine.proc.returncode}; restarting it")
                engine.start()
                engine.wait_ready(900)
                say("loraplex: engine restarted")
            for f in fronts:
                if f.proc.poll() is not None:
                    log.warning("%s exited with code %s; restarting it", f.name, f.proc.returncode)
                    f.start()
        return 0
    except RuntimeError as e:
        say(f"loraplex: error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(fronts, engine, shutdown_timeout)
        shutil.rmtree(run_dir, ignore_errors=True)     # its socket, metrics files, adapter journal, [auth] keys
        say("loraplex: stopped")


def reload_auth(auth_file: AuthFile, fronts: list[Child]) -> None:
    """SIGHUP: the [auth] table read again, then each frontend told to take it (frontends/auth_reload.py)."""
    try:
        held = auth_file.reload()
    except (ValueError, OSError) as e:
        say(f"loraplex: [auth] not reloaded, the running keys stay: {e}", file=sys.stderr)
        return
    for f in fronts:
        if f.proc and f.proc.poll() is None:
            f.proc.send_signal(signal.SIGHUP)
    say(f"loraplex: [auth] reloaded: {held}", file=sys.stderr)


def stop_all(fronts: list[Child], engine: Child, shutdown_timeout: float) -> None:
    """Drain, then stop: each frontend stops taking connections and gives its running requests
    `shutdown_timeout` seconds to finish (the engine still serves them); then the engine stops."""
    for f in fronts:
        f.stop()
    for f in fronts:
        f.kill_if_alive(shutdown_timeout + 10)
    engine.stop()
    engine.kill_if_alive(shutdown_timeout + 15)
