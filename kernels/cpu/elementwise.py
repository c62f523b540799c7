"""ctypes binding of the fused elementwise ops (elementwise.c): rms_norm, add_rms_norm, silu_mul,
gelu_tanh_mul, rope_, dora_scale_, write_kv, argmax over bf16 rows, and mask_logits_ (structured outputs).

Each equals the torch expression named in its docstring, rounding included. Requires supports(dtype).
"""
from __future__ import annotations

import torch

from kernels.cpu.build import load_functions

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_FNS: dict | None | bool = False   # False until first use


def _fns():
    global _FNS
    if _FNS is False:
        _FNS = {}
        for op in ("rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "rope", "dora_scale"):
            fns = load_functions("elementwise", {dt: f"{op}_{sfx}" for dt, sfx in _SUFFIX.items()})
            if fns is None:
                _FNS = None
                break
            for dt, fn in fns.items():
                _FNS[(op, dt)] = fn
        if _FNS is not None:
            _FNS["argmax"] = load_functions("elementwise", {0: "argmax_bf16"})[0]
            _FNS["write_kv"] = load_functions("elementwise", {0: "write_kv"})[0]
            _FNS.update({("mask_logits", dt): fn for dt, fn in load_functions(
                "elementwise", {dt: f"mask_logits_{sfx}" for dt, sfx in _SUFFIX.items()}).items()})
    return _FNS


def supports(dtype: torch.dtype) -> bool:
    fns = _fns()
    return fns is not None and ("rope", dtype) in fns


def _rows(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> weight * F.rms_norm(x.float(), (H,), eps=eps).to(x.dtype)."""
    _rows(x)
    assert weight.is_contiguous() and weight.dtype == x.dtype and weight.shape == x.shape[1:]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _fns()[("rms_norm", x.dtype)](x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                                  x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In place x += d (the residual add, rounded as torch's), then return rms_norm(x, weight, eps)."""
    _rows(x)
    _rows(d)
    assert d.shape == x.shape and d.dtype == x.dtype
    assert weight.is_contiguous() and weight.dtype == x.dtype and weight.shape == x.shape[1:]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _fns()[("add_rms_norm", x.dtype)](x.data_ptr(), x.stride(0), d.data_ptr(), d.stride(0), weight.data_ptr(),
                                      out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> F.silu(gate) * up, [T, I], where gate, up = gate_up.chunk(2, -1)."""
    return _gated(gate_up, "silu_mul")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> F.gelu(gate, approximate="tanh") * up, [T, I] (tanhf: a result may round one
    bf16 step from torch's)."""
    return _gated(gate_up, "gelu_tanh_mul")


def _gated(gate_up: torch.Tensor, op: str) -> torch.Tensor:
    _rows(gate_up)
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    _fns()[(op, gate_up.dtype)](gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), t, two_i // 2)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place, x: [T, heads, d] (each row's heads contiguous); cos, sin: [T, d] contiguous ->
    x * cos + rotate_half(x) * sin, each product rounded to x.dtype as torch does."""
    t, heads, d = x.shape
    assert x.stride()[1:] == (d, 1) and cos.shape == sin.shape == (t, d) and cos.is_contiguous() and sin.is_contiguous()
    assert x.dtype == cos.dtype == sin.dtype
    _fns()[("rope", x.dtype)](x.data_ptr(), x.stride(0), t, heads, d, cos.data_ptr(), sin.data_ptr())
    return x


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
             offsets: torch.Tensor) -> None:
    """k_cache[pages, offsets] = k; v_cache[pages, offsets] = v. Caches: [num_pages, block_size, kv_heads, d]
    sharing one page stride, each page's block contiguous; k, v: [T, kv_heads, d] with each token's row
    contiguous; pages, offsets: [T] int64 (in range: not checked here)."""
    t, kvh, d = k.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride()[1:] == (kvh * d, d, 1)
    assert k.shape == v.shape and k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and pages.dtype == offsets.dtype == torch.int64
    assert pages.is_contiguous() and offsets.is_contiguous() and pages.shape == offsets.shape == (t,)
    es = k.element_size()
    _fns()["write_kv"](k.data_ptr(), k.stride(0) * es, v.data_ptr(), v.stride(0) * es, k_cache.data_ptr(),
                       v_cache.data_ptr(), k_cache.stride(0) * es, pages.data_ptr(), offsets.data_ptr(), t,
                       kvh * d * es)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [T, n] bf16 (rows contiguous) -> x.argmax(-1), int64 [T] (the first largest; the first NaN if any)."""
    _rows(x)
    assert x.dtype == torch.bfloat16 and x.shape[1] > 0
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fns()["argmax"](x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def mask_logits_(x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place, for each row r in `rows`: x[r, i] = -inf where bit i % 32 of mask[r, i // 32] is 0
    (Backend.mask_logits_) -> x. x: [B, n] bf16 or fp32; mask: [B, ceil(n / 32)] int32, contiguous; rows:
    int64."""
    _rows(x)
    assert mask.dtype == torch.int32 and mask.is_contiguous()
    assert mask.shape[0] == x.shape[0] and mask.shape[1] * 32 >= x.shape[1]
    rows = rows.contiguous()
    _fns()[("mask_logits", x.dtype)](x.data_ptr(), x.stride(0), x.shape[1], mask.data_ptr(), mask.stride(0),
                                     rows.data_ptr(), rows.numel())
    return x


def dora_scale_(y: torch.Tensor, storage: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """In place y[t] = addcmul(y[t], y[t], d_t) for each row t with offs[t] >= 0, d_t =
    storage.view(-1)[offs[t]:offs[t] + N] (Backend.dora_scale) -> y. y: [T, N]; offs: [T] int64."""
    _rows(y)
    assert storage.dtype == y.dtype and storage.is_contiguous() and offs.dtype == torch.int64 and offs.is_contiguous()
    assert offs.shape == (y.shape[0],)
    _fns()[("dora_scale", y.dtype)](y.data_ptr(), y.stride(0), storage.data_ptr(), offs.data_ptr(), y.shape[0],
                                    y.shape[1])
    return y
