"""Compile every Triton kernel for real GPU targets, as the engine's launches call it, on a machine with no GPU.

The interpreter (TRITON_INTERPRET=1) runs the kernels' Python on CPU tensors: it checks what they compute,
not that they compile. Here the launch wrappers (`lora_ops.*`, `paged_attention.paged_attention`) run on
CPU tensors of real model shapes with each kernel's launch replaced by a recorder; every distinct recorded
launch (argument types and constexprs) then goes through Triton's own pipeline (TTIR -> TTGIR -> LLVM ->
PTX -> cubin; the triton wheel ships ptxas) for each target, and its shared memory is checked against the
target's limit. Registers, spills and the resulting occupancy come from ptxas's own report
(`resource_usage`); a spill is reported, not failed. Speed needs a GPU.

Run in a process without TRITON_INTERPRET (triton reads it once, at import):
    python -m bench.triton.compile_check [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bench.triton import resource_usage

# (name, compute capability, shared memory per block in bytes): A100, L4 / L40S, H100
TARGETS = (("sm_80", 80, 166912), ("sm_89", 89, 101376), ("sm_90", 90, 232448))
LAUNCH_OPTIONS = ("num_warps", "num_stages")
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32"}


@dataclass(frozen=True)
class Shape:
    """What the launches depend on: a Llama's projections and KV layout, the page size and the batch."""
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    block_size: int

    @property
    def page_elems(self) -> int:
        return self.block_size * self.layers * 2 * self.kv_heads * self.head_dim


SHAPES = (Shape("SmolLM2-135M", 576, 9, 3, 64, 1536, 30, 32), Shape("Llama-3-8B", 4096, 32, 8, 128, 14336, 32, 16))


@dataclass(frozen=True)
class Launch:
    kernel: object                      # a triton JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...] = ()     # launch options: num_warps, num_stages

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


class _Recorder:
    """Stands in for `kernel[grid](*args, **constexprs)`: records the launch instead of running it."""

    def __init__(self, kernel, launches: set[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return self._record

    def _record(self, *args, **kwargs) -> None:
        names = [p.name for p in self.kernel.params if not p.is_constexpr]
        assert len(names) == len(args), f"{self.kernel.fn.__name__}: {len(args)} arguments for {names}"
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        self.launches.add(Launch(self.kernel, tuple((n, _type_of(a)) for n, a in zip(names, args)),
                                 tuple(sorted(kwargs.items())), tuple(sorted(options.items()))))


@contextmanager
def recording(launches: set[Launch]) -> Iterator[None]:
    """Within, every kernel launch of lora_ops and paged_attention is recorded into `launches`."""
    from kernels.triton import lora_ops, paged_attention
    saved = []
    for module in (lora_ops, paged_attention):
        for attr, value in vars(module).items():
            if attr.endswith("_kernel"):
                saved.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launches))
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def record_step(shape: Shape, dtype: torch.dtype, max_rank: int) -> set[Launch]:
    """The launches of one mixed step (decode tokens, prefill segments, every module, attention)."""
    from kernels.triton import lora_ops, paged_attention
    launches: set[Launch] = set()
    q, kv, H, I = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    pool = torch.zeros(2 * shape.page_elems, dtype=dtype)
    table = torch.zeros(3, 4, dtype=torch.int64)
    off, rank = torch.zeros(3, dtype=torch.int64), torch.full((3,), max_rank, dtype=torch.int64)
    scale, idx = torch.ones(3), torch.tensor([0, 1, -1, 2])
    seg_start, seg_adapter = torch.tensor([0, 3, 5]), torch.tensor([1, -1])
    P = shape.page_elems
    with recording(launches):
        for n_in, n_out in ((H, q + 2 * kv), (q, H), (H, 2 * I), (I, H)):       # the fused projections
            x, y = torch.zeros(4, n_in, dtype=dtype), torch.zeros(4, n_out, dtype=dtype)
            v = lora_ops.bgmv_shrink(x, pool, table, off, rank, idx, max_rank, P)
            lora_ops.bgmv_expand(v, y, pool, table, off, rank, scale, idx, [0, n_out], P)
            v = lora_ops.sgmv_shrink(x, pool, table, off, rank, seg_start, seg_adapter, max_rank, 3, P)
            lora_ops.sgmv_expand(v, y, pool, table, off, rank, scale, seg_start, seg_adapter, [0, n_out], 3, P)
        paged = pool.view(2, shape.layers, 2, shape.block_size, shape.kv_heads, shape.head_dim)
        rows = paged_attention.tile_rows(shape.heads, shape.kv_heads, shape.head_dim, dtype)
        tiles = torch.tensor([[0, 0, rows, 1], [1, rows, 1, 1]], dtype=torch.int32)
        for max_rows, max_len in ((1, 1), (rows, 1), (1, 4 * paged_attention.SPLIT_KEYS)):
            # a decode-only step, a step with a prefill, a long decode split over programs
            paged_attention.paged_attention(torch.zeros(rows + 1, shape.heads, shape.head_dim, dtype=dtype),
                                            paged[:, 0, 0], paged[:, 0, 1], table[:2, :2].to(torch.int32),
                                            tiles[1:] if max_rows == 1 else tiles, max_rows,
                                            shape.head_dim ** -0.5, max_len)
    return launches


def compile_launch(launch: Launch, capability: int):
    """-> triton's CompiledKernel for the target (raises what the compiler raised)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = dict(launch.signature) | {name: "constexpr" for name, _ in launch.constexprs}
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=dict(launch.constexprs))
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))


def check(shapes=SHAPES, dtypes=(torch.bfloat16, torch.float32), ranks=(8, 64), targets=TARGETS,
          out=sys.stdout) -> list[str]:
    """Record the launches of steps in every shape, dtype and largest rank; compile them (compile_all)."""
    launches: set[Launch] = set()
    for shape in shapes:
        for dtype in dtypes:
            for r in ranks:
                launches |= record_step(shape, dtype, r)
    return compile_all(launches, targets, out)


def compile_all(launches: set[Launch], targets=TARGETS, out=sys.stdout) -> list[str]:
    """Compile every launch for every target; print one line each; return the failures."""
    failures = []
    for launch in sorted(launches, key=lambda x: (x.name, x.signature, str(x.constexprs))):
        types = dict(launch.signature)
        dtype = next((types[p] for p in ("pool_ptr", "q_ptr", "o_ptr") if p in types), "?")
        for name, capability, shared_limit in targets:
            what = f"{launch.name} {dtype} {dict(launch.constexprs + launch.options)} {name}"
            start = time.perf_counter()
            try:
                compiled = compile_launch(launch, capability)
                shared, use = compiled.metadata.shared, resource_usage.usage(compiled, capability)
            except Exception as e:  # noqa: BLE001 - report every kernel, whatever the compiler raised
                failures.append(f"{what}: {type(e).__name__}: {_reason(e)}")
                print(f"FAIL {failures[-1]}", file=out)
                continue
            ok = shared <= shared_limit
            if not ok:
                failures.append(f"{what}: {shared} bytes of shared memory, the target has {shared_limit}")
            print(f"{'ok  ' if ok else 'FAIL'} {what}: shared {shared} B, {use.registers} registers, "
                  f"spills {use.spill_bytes} B, {use.warps_per_sm}/{use.max_warps} warps per SM, "
                  f"{time.perf_counter() - start:.2f} s", file=out)
    return failures


def _reason(e: BaseException) -> str:
    """The innermost cause's message (triton wraps a nested function's error in its caller's)."""
    while e.__cause__ is not None:
        e = e.__cause__
    message = getattr(e, "error_message", None)
    lines = [line for line in str(e).splitlines() if line.strip()]
    return message or (lines[-1] if lines else type(e).__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the default model's shape only, on sm_80 and sm_90")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)", file=sys.stderr)
        return 2
    kw = dict(shapes=SHAPES[:1], targets=(TARGETS[0], TARGETS[2])) if args.quick else {}
    failures = check(**kw)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
