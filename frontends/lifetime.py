"""No process outlives the one that started it, and no server starts on a port another one holds.

- `die_with_parent`: a child started with it gets SIGTERM when its parent dies, however the parent dies
  (SIGKILL, the OOM killer, a Ray replica replaced): the engine and the frontends then drain and exit as
  on any SIGTERM (Linux's PR_SET_PDEATHSIG; it fires when the thread that started the child ends, so
  children are started from the launcher's main thread).
- `port_holder`: who already accepts connections on host:port (SO_REUSEPORT would otherwise let a second
  server start beside the first and split the port's requests between them).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM):
    """A preexec_fn for subprocess.Popen: the child gets `sig` when the process that starts it dies."""
    parent = os.getpid()

    def arm() -> None:
        # a mask is inherited across exec: a child of a Ray process (the launcher starts Ray with SIGTERM
        # blocked, ray_launcher.start_ray) must be able to receive the signal it is armed with
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:        # the parent died before the prctl took effect
            os.kill(os.getpid(), sig)
    return arm


def port_holder(host: str, port: int) -> str | None:
    """None if nothing accepts connections on host:port; else who does, in words (the pid and command of
    the listening process where /proc tells it)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass
    except OSError:
        return None
    holders = [f"pid {pid} ({cmd})" for pid, cmd in _listeners(port)]
    return ", ".join(holders) if holders else "another process"


def _listeners(port: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes with a socket listening on `port` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append((int(proc.name), cmd[:120]))
    return sorted(found)
