"""The short version of `make soak` (bench/soak.py): 400 requests over 60 adapters, two frontends, three
tenants, 10% abandoned, a frontend and then the engine killed with SIGKILL. Its checks must all pass:
every request accounted for, exact token counts, the pool at zero pages after unloading, the engine's RSS
within 10%, /metrics agreeing with the clients."""
from __future__ import annotations

import subprocess
import sys


def test_short_soak_passes_its_checks(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--requests", "400", "--adapters", "60",
                          "--concurrency", "32", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[ok] pool at zero pages" in run.stdout and "FAILED" not in run.stdout
    assert "SIGKILL to the engine" in run.stdout and "SIGKILL to frontend" in run.stdout
