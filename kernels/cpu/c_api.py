"""The ctypes side of the C API declared in csrc/loraplex_kernels.h: each library (a .c file of csrc/) and
the functions it exports, with their signatures. `build.load_functions` sets these on every function it
loads, and tests/kernels/cpu/test_c_api.py checks them against the header and the built libraries."""
from __future__ import annotations

import ctypes

P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
INT, VOID = ctypes.c_int, None

_NORM = [P, I64, P, P, I64, I64, I, F]                              # x, x_stride, w, out, out_stride, rows, H, eps
_ADD_NORM = [P, I64, P, I64, P, P, I64, I64, I, F]
_SILU = [P, I64, P, I64, I64, I]
_ROPE = [P, I64, I64, I, I, P, P]
_GEMM = [P, I64, P, P, I64, I, I, I]                                # x, xs, packed, y, ys, M, K, N
_LORA = [P, I64, P, I64, P, P, P, I, P, I, I, I, P, P]   # x, xs, y, ys, tok, slot, rank, n, a, R, G, in, b, out
_TILED = [P, P, P, P, I64, P, I64, P, I, I, I, I, I, F, I, I64, F]

# library -> {function: (return type, argument types)}
LIBRARIES: dict[str, dict[str, tuple]] = {
    "elementwise": {
        "rms_norm_bf16": (VOID, _NORM), "rms_norm_f32": (VOID, _NORM),
        "add_rms_norm_bf16": (VOID, _ADD_NORM), "add_rms_norm_f32": (VOID, _ADD_NORM),
        "silu_mul_bf16": (VOID, _SILU), "silu_mul_f32": (VOID, _SILU),
        "gelu_tanh_mul_bf16": (VOID, _SILU), "gelu_tanh_mul_f32": (VOID, _SILU),
        "rope_bf16": (VOID, _ROPE), "rope_f32": (VOID, _ROPE),
        "dora_scale_bf16": (VOID, [P, I64, P, P, I64, I]), "dora_scale_f32": (VOID, [P, I64, P, P, I64, I]),
        "write_kv": (VOID, [P, I64, P, I64, P, P, I64, P, P, I64, I64]),
        "argmax_bf16": (VOID, [P, I64, I64, I64, P]),
        "mask_logits_f32": (VOID, [P, I64, I64, P, I64, P, I64]),
        "mask_logits_bf16": (VOID, [P, I64, I64, P, I64, P, I64]),
    },
    "gemm_avx512bf16": {"gemm_bf16": (INT, _GEMM), "gemm_amx": (INT, [I])},
    "gemm_lora_avx512bf16": {"gemm_lora_bf16": (INT, [*_GEMM, P, P, P, I, I, P, P, P, I64]), "gemm_amx": (INT, [I])},
    "gemm_avx2": {"gemm_bf16_avx2": (INT, _GEMM)},
    "lora": {"lora_decode_bf16": (INT, _LORA), "lora_decode_f32": (INT, _LORA), "gemm_amx": (INT, [I]),
             "lora_segments_bf16": (INT, [P, I64, P, I64, P, P, P, P, I, P, I, I, I, P, P])},
    "lora_pack": {"pack_lora": (INT, [P, P, I, P, I])},
    "attention_tiled": {"paged_tiled_attention_bf16": (INT, _TILED), "paged_tiled_attention_f32": (INT, _TILED)},
    "attention_avx512bf16": {
        "paired_attention_bf16": (INT, [P, I64, P, P, P, I64, P, I64, P, I, I, I, I, I, F, I64, F]),
        "write_kv_paired_bf16": (INT, [P, I64, P, I64, P, P, I64, P, P, I64, I, I, I]),
    },
    "decoder": {"decoder_layers_bf16": (INT, [P]), "gemm_amx": (INT, [I])},
}
