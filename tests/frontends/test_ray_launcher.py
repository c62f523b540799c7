"""What each replica's server is started with: the application's own flags removed, paths absolute."""
from __future__ import annotations

import os

from frontends.ray_launcher import replica_argv


def test_replica_argv_drops_the_application_flags_and_makes_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    argv = ["serve", "--replicas", "2", "--ray-address=10.0.0.1:6379", "--adapter-dir", "adapters", "--port", "8000",
            "--host", "0.0.0.0", "--frontends", "3", "--max-adapters-per-replica", "8", "--max-loras", "4",
            "--replica-routing", "random", "--replica-load-bound", "1.25", "--dtype", "float32"]
    assert replica_argv(argv) == ["--adapter-dir", os.path.join(str(tmp_path), "adapters"), "--max-loras", "4",
                                  "--dtype", "float32", "--replicas", "1"]
