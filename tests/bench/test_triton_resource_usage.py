"""ptxas's report parsed, and occupancy as the CUDA Occupancy Calculator computes it."""
from __future__ import annotations

import pytest

from bench.triton import resource_usage as ru

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_bgmv_expand_kernel' for 'sm_90a'
ptxas info    : Function properties for _bgmv_expand_kernel
    8 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers
"""


def test_parse_reads_registers_and_adds_spill_stores_and_loads():
    assert ru.parse(LOG) == (48, 32)


def test_parse_refuses_a_report_without_registers():
    with pytest.raises(ValueError, match="no register report"):
        ru.parse("ptxas fatal   : Unresolved extern function")


@pytest.mark.parametrize("capability, registers, warps, shared, expected", [
    (80, 40, 4, 0, 48),          # registers: 40 x 32 = 1,280 per warp -> 12 blocks of 4 warps
    (80, 248, 4, 0, 8),          # 7,936 per warp -> 2 blocks
    (90, 33, 4, 0, 48),          # 33 x 32 rounds up to 1,280 per warp, as 40 does
    (89, 16, 1, 0, 24),          # Ada: at most 24 resident blocks
    (80, 16, 8, 0, 64),          # the resident-warp limit
    (89, 32, 4, 50 * 1024, 4),   # shared: 102,400 // (51,200 + 1,024 reserved) = 1 block
    (90, 32, 4, 56 * 1024, 16),  # 233,472 // 58,368 = 4 blocks
])
def test_resident_warps(capability, registers, warps, shared, expected):
    assert ru.resident_warps(capability, registers, warps, shared) == expected


def test_occupancy_is_the_share_of_the_targets_warps():
    assert ru.Usage(registers=40, spill_bytes=0, warps_per_sm=48, max_warps=64).occupancy == 0.75
