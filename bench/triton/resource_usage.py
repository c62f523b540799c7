"""Registers, spills and occupancy of a compiled Triton kernel, read from ptxas without a GPU.

Triton's CompiledKernel learns `n_regs` / `n_spills` only when a driver loads the cubin. The same figures
come from the assembler itself: `ptxas -v` on the kernel's PTX (the ptxas the triton wheel ships, with the
flags Triton passes) prints them. Occupancy follows from them and the block's shared memory with the
per-SM limits of each target (the CUDA Occupancy Calculator's arithmetic: registers are allocated per warp
in units of 256, and every block takes 1 KiB of shared memory beyond its own).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass

# compute capability -> (registers, shared memory bytes, resident warps, resident blocks) per SM
SM_LIMITS = {80: (65536, 167936, 64, 32), 89: (65536, 102400, 48, 24), 90: (65536, 233472, 64, 32)}
REG_UNIT = 256          # registers are allocated to a warp in units of this many
BLOCK_SHARED = 1024     # shared memory the system reserves per resident block


@dataclass(frozen=True)
class Usage:
    """One kernel on one target. Invariant: warps_per_sm <= the target's resident-warp limit."""
    registers: int      # per thread
    spill_bytes: int    # spill stores + spill loads, per thread
    warps_per_sm: int   # resident warps one SM holds (registers, shared memory and block limits)
    max_warps: int      # the target's limit, for the ratio

    @property
    def occupancy(self) -> float:
        return self.warps_per_sm / self.max_warps


def ptxas_log(ptx: str, capability: int, fp_fusion: bool = True) -> str:
    """`ptxas -v`'s report for `ptx` compiled for sm_<capability> (raises CalledProcessError on failure)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    arch = sm_arch_from_capability(capability)
    cmd = [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}"]
    cmd += [] if fp_fusion else ["--fmad=false"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        return subprocess.run([*cmd, src.name, "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr


def parse(log: str) -> tuple[int, int]:
    """-> (registers per thread, spill bytes per thread) from a one-kernel `ptxas -v` report."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise ValueError(f"no register report in ptxas output: {log[-300:]!r}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


def resident_warps(capability: int, registers: int, num_warps: int, shared: int) -> int:
    """Warps of blocks of `num_warps` warps, `registers` per thread and `shared` bytes that one SM holds."""
    sm_regs, sm_shared, max_warps, max_blocks = SM_LIMITS[capability]
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    blocks = min(max_blocks, max_warps // num_warps, sm_regs // (per_warp * num_warps),
                 sm_shared // (shared + BLOCK_SHARED))
    return blocks * num_warps


def usage(compiled, capability: int) -> Usage:
    """Usage of triton's CompiledKernel `compiled` (built for `capability`) on that target."""
    meta = compiled.metadata
    regs, spills = parse(ptxas_log(compiled.asm["ptx"], capability, meta.enable_fp_fusion))
    warps = resident_warps(capability, regs, meta.num_warps, meta.shared)
    return Usage(regs, spills, warps, SM_LIMITS[capability][2])
