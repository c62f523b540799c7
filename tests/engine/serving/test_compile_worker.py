"""The compile worker (engine/serving/compile_worker.py), a real child process on the default model's
tokenizer: a constraint compiled there is installed and generates as one compiled in process; a bad one is
a ValueError naming it; a compile past its time limit kills the worker, and the next compile gets a fresh
one, so a hostile constraint costs its time limit once and blocks no one after it."""
from __future__ import annotations

import time

import pytest

from engine.serving.compile_worker import CompileTimeout, CompileWorker
from engine.structured_output import Grammars
from ipc.sampling_params import StructuredOutputsParams

SLOW = StructuredOutputsParams(json={"type": "string", "pattern": "a{30000}"})    # minutes here


@pytest.fixture(scope="module")
def worker(model_dir):
    from engine.config import EngineConfig
    m = EngineConfig.create(model=str(model_dir)).model
    w = CompileWorker(str(model_dir), m.vocab_size, m.eos_token_ids)
    yield w, Grammars(str(model_dir), m.vocab_size, m.eos_token_ids)
    w.close()


def test_a_grammar_compiled_in_the_worker_matches_as_one_compiled_here(worker):
    w, grammars = worker
    spec = StructuredOutputsParams(choice=["yes", "no"])
    grammars.install(spec, w.compile(spec, timeout=60))
    assert grammars.is_compiled(spec)
    here = Grammars(grammars.tokenizer_path, grammars.vocab_size, grammars.eos)
    tok = here.tokenizer_info()
    ids = [i for i, t in enumerate(tok.decoded_vocab) if t in (b"yes", b"no")]
    for t in ids:
        a, b = grammars.matcher(spec), here.matcher(spec)
        assert a.accept(t) == b.accept(t) and a.done == b.done
    with pytest.raises(ValueError, match=r"structured_outputs.regex: .*parenthesis"):
        w.compile(StructuredOutputsParams(regex="(ab"), timeout=60)


def test_a_compile_past_its_limit_kills_the_worker_and_the_next_one_gets_a_fresh_one(worker):
    w, grammars = worker
    w.compile(StructuredOutputsParams(regex="[0-9]+"), timeout=60)          # started
    first = w.proc
    t = time.monotonic()
    with pytest.raises(CompileTimeout):
        w.compile(SLOW, timeout=1.0)
    assert time.monotonic() - t < 5 and first.poll() is not None            # killed, not left compiling
    spec = StructuredOutputsParams(regex="[a-z]+")
    grammars.install(spec, w.compile(spec, timeout=60))
    assert w.proc is not first and w.proc.poll() is None


def test_the_worker_dies_with_the_process_that_started_it(model_dir, tmp_path):
    """Even mid-compile: a SIGKILLed engine leaves no worker compiling for minutes."""
    import os
    import signal
    import subprocess
    import sys
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys\nfrom engine.config import EngineConfig\nfrom engine.serving.compile_worker import CompileWorker\n"
        "from ipc.sampling_params import StructuredOutputsParams as S\n"
        f"m = EngineConfig.create(model={str(model_dir)!r}).model\n"
        f"w = CompileWorker({str(model_dir)!r}, m.vocab_size, m.eos_token_ids)\n"
        "w.compile(S(regex='[0-9]+'), 60)\nprint(w.proc.pid, flush=True)\n"
        "w.compile(S(json={'type': 'string', 'pattern': 'a{30000}'}), 600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    pid = int(parent.stdout.readline())
    time.sleep(0.5)                                             # compiling now
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":                      # gone, not yet reaped (its parent is dead)
                return
        time.sleep(0.05)
    pytest.fail(f"compile worker {pid} outlived its parent")
