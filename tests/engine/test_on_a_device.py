"""The whole engine with its device set to "cuda", on a machine without a GPU: the meta device stands in.

A meta tensor has a shape, a dtype and a device, and no data. Like a CUDA tensor it refuses to meet a host
tensor in an op (0-dim ones aside), and it refuses every operation that would make the host wait for a
GPU: reading values (`item`, `bool`, `tolist`, `.cpu()`) and ops whose output size depends on values
(`nonzero`, boolean masks, `unique`, `repeat_interleave` without a size). With "cuda" mapped to meta, a
run of the engine shows that every tensor of a step lives on the device (weights, the pool, the step's
metadata, the adapters' page tables) and what the step reads back: each `tolist` of a meta tensor is
recorded (it returns zeros: nothing is computed here, so every sampled token is 0).

The page copier runs its CUDA branch, with stand-ins for the side stream and its events (an event is not
done at its first query: a copy in flight). Not exercised here: the Triton kernels' bodies
(tests/kernels/triton runs them in the interpreter; here a launch checks that each tensor it is given is on
the device) and real streams.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import engine.lora.adapter_manager as adapter_manager
import engine.lora.loader as loader
import kernels.selector as selector
from bench.adapters import write_peft_adapter
from bench.tiny_model import make_tiny_llama
from engine.config import ModelConfig
from engine.llm import LLM
from engine.lora.page_copier import PageCopier
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams
from kernels.triton import dora_ops, lora_ops, paged_attention
from kernels.triton.backend import TritonBackend

DEVICE = torch.device("meta")
KERNELS = {lora_ops: ("_bgmv_shrink_kernel", "_bgmv_expand_kernel", "_sgmv_shrink_kernel", "_sgmv_expand_kernel"),
           paged_attention: ("_paged_attention_kernel",), dora_ops: ("_dora_scale_kernel",)}
RANKS = {"a-r3": (3, ("q_proj", "v_proj")), "a-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj")),
         "a-r16": (16, ("o_proj", "down_proj", "k_proj")), "a-r5": (5, ("q_proj", "up_proj", "gate_proj"))}
PROMPTS = [list(range(300, 341)), [5, 6, 7], list(range(900, 917)), [1, 4093, 314, 253, 1345, 282, 2716, 30]]


class Launch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args)` checks that every tensor is on the device."""

    def __init__(self, name: str):
        self.name = name
        self.count = 0

    def __getitem__(self, grid):
        return functools.partial(self.run, grid)

    def run(self, grid, *args, **kwargs):
        args = [*args, *kwargs.values()]
        away = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device != DEVICE]
        assert not away, f"{self.name}: arguments {away} are not on the device"
        self.count += 1


class Stream:
    """Stands in for torch.cuda.Stream; `log` is shared with the events and the copier's calls."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "Stream") -> None:
        self.log.append(("wait", self.name, other.name))


class Event:
    """Stands in for torch.cuda.Event: not done at its first query (a copy still in flight), done after."""

    def __init__(self, log: list):
        self.log, self.queries, self.stream = log, 0, None

    def record(self, stream: Stream) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name))

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 1

    def synchronize(self) -> None:
        self.queries = 2


class StreamCopier(PageCopier):
    """The page copier's CUDA branch, run for real with stand-ins for the side stream and its events."""

    def __init__(self, storage):
        super().__init__(storage)
        self.log: list = []
        self.cuda, self.stream, self.compute = True, Stream("side", self.log), Stream("compute", self.log)
        self.events: list[Event] = []

    def copy(self, adapter_id, pages, packed):
        self.log.append(("copy", adapter_id))
        super().copy(adapter_id, pages, packed)
        self.events.append(self.pending[adapter_id][0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    d = tmp_path_factory.mktemp("on-a-device")
    make_tiny_llama(d / "model", model_dir)
    cfg = ModelConfig.from_dir(d / "model", torch.float32, "tiny", None)
    for i, (name, (r, targets)) in enumerate(RANKS.items()):
        write_peft_adapter(d / "adapters" / name, cfg, r=r, targets=targets, seed=i, std=0.3)
    return d


@pytest.fixture
def reads(monkeypatch):
    """"cuda" is the meta device; Triton launches and page copies check placement; the list of
    (shape, dtype) of every tensor read back from the device, in order."""
    real_resolve, real_tolist, log = selector.resolve_device, torch.Tensor.tolist, []

    def tolist(t):
        if t.device != DEVICE:
            return real_tolist(t)
        log.append((tuple(t.shape), t.dtype))
        return real_tolist(torch.zeros(t.shape, dtype=t.dtype))

    monkeypatch.setattr(selector, "resolve_device", lambda d: DEVICE if str(d) == "cuda" else real_resolve(d))
    monkeypatch.setattr(TritonBackend, "runs_on", staticmethod(lambda device: True))
    copiers: list[StreamCopier] = []

    def copier(storage):
        copiers.append(StreamCopier(storage))
        return copiers[-1]

    @contextlib.contextmanager
    def on_stream(stream):
        stream.log.append(("enter", stream.name))
        yield
        stream.log.append(("exit", stream.name))

    monkeypatch.setattr(adapter_manager, "PageCopier", copier)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: copiers[-1].compute)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: Event(copiers[-1].log))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)       # no pinned memory without a GPU
    monkeypatch.setattr(loader, "host_buffer", lambda n, dtype, pin: torch.empty(n, dtype=dtype))
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Launch(name))
    return log


@pytest.fixture
def sends(monkeypatch):
    """The shape of every host index tensor (not adapter weights) copied to the device by `Tensor.to`."""
    real_to, log = torch.Tensor.to, []

    def to(t, *args, **kwargs):
        out = real_to(t, *args, **kwargs)
        if t.device.type == "cpu" and out.device == DEVICE and not t.is_floating_point():
            log.append(tuple(t.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return log


def counting_steps(llm: LLM, log: list) -> list[int]:
    """From now on, how many entries each engine step that runs the model adds to `log`, one count per such
    step (a step that only waits for an adapter's load, which a loaded host makes likelier, runs none)."""
    counts, real_step, runner = [], llm.engine.step, llm.engine.runner
    real_execute, ran = runner.execute, []

    def execute(*args, **kwargs):
        ran.append(True)
        return real_execute(*args, **kwargs)

    def step():
        before = len(log)
        ran.clear()
        out = real_step()
        if ran:
            counts.append(len(log) - before)
        return out
    runner.execute = execute
    llm.engine.step = step
    return counts


def engine_on_device(tiny, backend: str, dtype: str = "bfloat16") -> LLM:
    llm = LLM(model=str(tiny / "model"), dtype=dtype, backend=backend, device="cuda", max_num_batched_tokens=32,
              long_prefill_token_threshold=24, kv_cache_memory_bytes=1 << 22, block_size=16)
    for name in RANKS:
        llm.register_adapter(name, str(tiny / "adapters" / name))
    return llm


def run(llm: LLM, params: list[SamplingParams], reads: list) -> list[tuple[int, list]]:
    """Four adapter requests and two base ones to the end, step by step: (tokens sampled, reads) per step."""
    core = llm.engine
    jobs = [*RANKS, None, None]
    for i, (name, p) in enumerate(zip(jobs, params)):
        core.add_request(GenerateRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], p, adapter=name))
    steps, finished = [], {}
    while core.has_unfinished():
        before = len(reads)
        outs = core.step()
        steps.append((sum(len(o.new_token_ids) for o in outs), reads[before:]))
        finished.update({o.request_id: o for o in outs if o.finish_reason})
    assert core.num_failed_steps == 0
    assert {rid: (o.finish_reason, o.error) for rid, o in finished.items()} == {
        f"r{i}": ("length", None) for i in range(len(jobs))}
    assert sum(n for n, _ in steps) == sum(p.max_tokens for p in params)
    return steps


def placement(llm: LLM) -> set[torch.device]:
    """The devices of the weights, the pool and the rotary tables."""
    runner, w = llm.engine.runner, llm.engine.runner.model.w
    tensors = [runner.storage, w.embed, w.norm, w.lm_head.weight, runner.model.rope.cos, runner.model.rope.sin]
    for layer in w.layers:
        tensors += [layer.input_norm, layer.post_norm, layer.qkv.weight, layer.o.weight, layer.gate_up.weight,
                    layer.down.weight]
    return {t.device for t in tensors}


@pytest.mark.parametrize("backend,dtype", [("triton", "bfloat16"), ("triton", "float32"), ("torch", "bfloat16")])
def test_a_greedy_step_lives_on_the_device_and_reads_back_only_its_token_ids(tiny, reads, sends, backend, dtype):
    llm = engine_on_device(tiny, backend, dtype)
    assert placement(llm) == {DEVICE}
    sent = counting_steps(llm, sends)
    steps = run(llm, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 6, reads)
    for sampled, step_reads in steps:
        assert step_reads == ([((sampled,), torch.int64)] if sampled else [])
    if backend == "triton":
        # a step's metadata goes in one transfer, its adapters' indices in one more; beyond that, only
        # each adapter's page index (its load) and its four per-module vectors (when first assigned)
        assert min(sent) >= 1 and sent[-1] in (1, 2), sent
        assert sum(sent) <= 2 * len(sent) + 5 * len(RANKS), sent
    copier = llm.engine.adapters.copier
    for adapter_id in {a.adapter_id for a in llm.engine.adapters.by_id.values()}:   # each load on the side stream
        at = copier.log.index(("copy", adapter_id))
        assert copier.log[at + 1:at + 5] == [("wait", "side", "compute"), ("enter", "side"), ("record", "side"),
                                             ("exit", "side")]
    assert len(copier.events) == len(RANKS) and all(e.queries >= 2 for e in copier.events)
    assert not copier.pending
    if backend == "triton":      # every kernel ran on the device: decode and prefill, with adapters (no DoRA one)
        launches = {name: getattr(m, name).count for m, names in KERNELS.items() for name in names}
        assert min(n for k, n in launches.items() if k != "_dora_scale_kernel") > 0, launches


def test_sampling_penalties_and_logprobs_read_back_a_few_transfers_a_step(tiny, reads):
    """Sampled rows next to greedy ones still give one read of the token ids; logprobs (sampled and prompt)
    three each, however many rows ask; penalties and min_tokens read nothing back."""
    llm = engine_on_device(tiny, "triton")
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1,
                             min_tokens=2, logit_bias={5: 1.0}, max_tokens=4),
              SamplingParams(temperature=0.5, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=4, ignore_eos=True, logprobs=0)]
    steps = run(llm, params, reads)
    for sampled, step_reads in steps:
        tokens = [r for r in step_reads if r == ((sampled,), torch.int64)]
        assert len(tokens) == (1 if sampled else 0), step_reads
        assert len(step_reads) - len(tokens) in (0, 3, 6), step_reads      # logprobs, prompt logprobs
    assert any(len(r) == 7 for _, r in steps), "a step read back both kinds of logprobs"


def test_the_warm_up_launches_every_triton_kernel_on_the_device(tiny, reads):
    """What a server on a GPU runs before it says it is ready (engine/core/warm_up.py): every Triton kernel a
    step launches, decode and prefill, with and without an adapter, so none compiles while serving."""
    from engine.core.warm_up import warm_up
    llm = engine_on_device(tiny, "triton")
    before = {name: getattr(m, name).count for m, names in KERNELS.items() for name in names}
    warm_up(llm.engine)
    after = {name: getattr(m, name).count for m, names in KERNELS.items() for name in names}
    assert all(after[k] > before[k] for k in after if k != "_combine_splits_kernel"), (before, after)
    assert not llm.engine.has_unfinished() and llm.engine.pool.usage()["adapter"] == 0


def test_wait_loads_returns_with_every_adapter_resident(tiny, reads):
    """On a GPU a load ends with the copy on the side stream: wait_loads (the warm-up's and bench_coldstart's
    way to wait) waits for the copies' events and marks the adapters resident, not only LOADING-and-landed."""
    from engine.lora.adapter_manager import AdapterState
    core = engine_on_device(tiny, "triton").engine
    for name in RANKS:
        core.prefetch_adapter(name)
    core.adapters.wait_loads()
    assert {core.adapters.lookup(n).state for n in RANKS} == {AdapterState.RESIDENT}
