"""Start and stop a real `loraplex serve` for a benchmark (the launcher's ready line gives the URL)."""
from __future__ import annotations

import subprocess
import sys
import time

from frontends import ready


def start_server(flags: list[str], quiet: bool = True) -> tuple[subprocess.Popen, str]:
    """`loraplex serve --port 0 FLAGS...` -> (the process, its base URL) once it says it is serving."""
    proc, url, _ = start_timed(flags, quiet)
    return proc, url


def start_timed(flags: list[str], quiet: bool = True) -> tuple[subprocess.Popen, str, float]:
    """As start_server, plus the seconds from the command to its ready line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if not quiet:
            sys.stderr.write(line)
        info = ready.parse(line)
        if info:
            took = time.perf_counter() - t0
            _drain(proc)
            return proc, info["url"], took
    raise RuntimeError("server did not start:\n" + "".join(lines[-30:]))


def _drain(proc: subprocess.Popen) -> None:
    """Keep reading the server's output so that it never blocks on a full pipe."""
    import threading
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
