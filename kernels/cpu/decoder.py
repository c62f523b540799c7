"""ctypes binding of decoder.c: all decoder layers of a step in one C call (the Llama layer with its family's
switches: q/k/v biases, q/k norms, sliding windows; AVX512-BF16, bf16 weights on the C GEMM, the paired KV
layout). The same kernels in the same order as the per-op layer loop of
engine/model/llama.py, so the same bits, without its Python and per-op parallel regions between them
(about 10 calls a layer; on a 64-row decode step, ~3 ms of Python per step on the hosts measured).

The model uses it for every step the C LoRA kernels cover: decode tokens' adapters inside the base GEMMs
(gemm_lora_avx512bf16.c), prefill tokens' by segment (lora_segments_bf16), in the op-by-op path's order. Other
steps (the torch LoRA path) add their deltas between the ops, in Python.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu import gemm as c_gemm
from kernels.cpu import lora as c_lora
from kernels.cpu.build import has_avx512_bf16, load_functions


class _Layer(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm",
                                               "k_cache", "v_cache", "qkv_bias", "q_norm", "k_norm")] + [
        ("window", ctypes.c_int64), ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
        ("local_rope", ctypes.c_int64)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Lora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("R", ctypes.c_int), ("G", ctypes.c_int), ("b", ctypes.c_void_p),
                ("out", ctypes.c_void_p)]


class _Args(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int) for n in ("num_layers", "T", "H", "heads", "kv_heads", "d", "I", "block_size")]
                + [("page_stride", ctypes.c_int64), ("max_blocks", ctypes.c_int64), ("eps", ctypes.c_float),
                   ("scale", ctypes.c_float), ("layers", ctypes.c_void_p)]
                + [(n, ctypes.c_void_p) for n in ("x", "h", "qkv", "attn", "o", "gate_up", "act", "down", "cos",
                                                  "sin", "pages", "offs", "tables", "lens", "lora", "slot", "rank",
                                                  "vp")]
                + [("vp_stride", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("seg_tok", "seg_start", "seg_slot", "seg_rank")]
                + [("n_seg", ctypes.c_int), ("local_cos", ctypes.c_void_p), ("local_sin", ctypes.c_void_p),
                   ("softcap", ctypes.c_float), ("gelu", ctypes.c_int), ("dora_base", ctypes.c_void_p),
                   ("dora", ctypes.c_void_p)])


@dataclass
class DecoderLora:
    """A step's adapters as the C decoder applies them, in the op-by-op path's order: per projection group,
    the rows with a slot inside the GEMM (gemm_lora_avx512bf16.c: row_slot, row_rank [T] int64, -1 for none; or None),
    then the segments' deltas (lora_segments_bf16: prefill tokens grouped by adapter; or None).
    weights(layer, group) -> that group's tables for the step (lora.Weights, paired B), or None: no adapter
    of the step targets it."""
    row_slot: torch.Tensor | None
    row_rank: torch.Tensor | None
    segments: c_lora.LoraSegments | None
    weights: Callable[[int, str], c_lora.Weights | None]


GROUPS = ("qkv", "o", "gate_up", "down")   # decoder.c's order of a layer's projection groups


_FN: object = False   # False until first use


def _fn():
    global _FN
    if _FN is False:
        fns = load_functions("decoder", {0: "decoder_layers_bf16"}) if has_avx512_bf16() else None
        _FN = None if fns is None else fns[0]
    return _FN


class Decoder:
    """kernels.backend.FusedDecoder: the decoder layers of one model over one KV pool, run(x, ...) the layer
    loop of LlamaModel.forward. Build with Decoder.create (None where this host or model cannot)."""

    def __init__(self, cfg, layers, kv_caches):
        self.cfg = cfg
        self.num_layers = len(layers)
        self.k_view = kv_caches[0][0]          # paired K view [pages, kvh, d / 2, bs, 2]
        self.layers = (_Layer * len(layers))(*[
            _Layer(w.qkv.c.packed_ptr, w.o.c.packed_ptr, w.gate_up.c.packed_ptr, w.down.c.packed_ptr,
                   w.input_norm.data_ptr(), w.post_norm.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(w.qkv_bias),
                   _ptr(w.q_norm), _ptr(w.k_norm), cfg.window(i), _ptr(w.attn_out_norm), _ptr(w.mlp_out_norm),
                   int(bool(cfg.window(i) and cfg.local_rope_theta)))
            for i, (w, (k, v)) in enumerate(zip(layers, kv_caches))])
        self._keep = (layers, kv_caches)       # the memory behind the pointers above

    @classmethod
    def create(cls, cfg, layers, kv_caches) -> "Decoder | None":
        """cfg: the ModelConfig; layers: LayerWeights; kv_caches: the paired (K, V) views per layer."""
        if _fn() is None or cfg.dtype != torch.bfloat16 or kv_caches[0][0].dim() != 5 or cfg.moe is not None:
            return None                        # (no experts in the C decoder: MoE models run op by op)
        for w in layers:
            for lin in (w.qkv, w.o, w.gate_up, w.down):   # packed for gemm_avx512bf16.c (not the AVX2 layout)
                if lin.c is None or lin.c.fns is not c_gemm.variant("avx512bf16"):
                    return None
            extras = [t for t in (w.qkv_bias, w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm) if t is not None]
            if not all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in [w.input_norm, w.post_norm, *extras]):
                return None
        return cls(cfg, layers, kv_caches)

    def _descriptors(self, lora: DecoderLora) -> tuple:
        """(the [L][4] descriptor array, the vp width, what they point into) of the step's adapted groups."""
        descs = (_Lora * (self.num_layers * len(GROUPS)))()
        width, keep = 1, []
        for layer in range(self.num_layers):
            for j, group in enumerate(GROUPS):
                w = lora.weights(layer, group)
                if w is None:
                    continue
                assert w.paired and w.dtype == torch.bfloat16
                descs[layer * len(GROUPS) + j] = _Lora(w.a, w.max_rank, w.groups, w.b, ctypes.addressof(w.outs))
                width = max(width, (w.max_rank + 1) // 2 * w.groups)
                keep.append(w)
        return descs, width, keep

    def _set_lora(self, args: _Args, lora: DecoderLora, t: int) -> list:
        """Fill args' LoRA fields; returns what must stay alive during the call."""
        descs, width, weights = self._descriptors(lora)
        keep = [descs, weights]
        args.lora = ctypes.addressof(descs)
        if lora.row_slot is not None:
            slot, rank = lora.row_slot, lora.row_rank
            assert slot.shape == rank.shape == (t,) and slot.dtype == rank.dtype == torch.int64
            assert slot.is_contiguous() and rank.is_contiguous()
            vp = torch.empty(t, width, dtype=torch.int32)
            args.slot, args.rank, args.vp, args.vp_stride = slot.data_ptr(), rank.data_ptr(), vp.data_ptr(), width
            keep += [slot, rank, vp]
        seg = lora.segments
        if seg is not None and seg.n:
            args.seg_tok, args.seg_start = seg.tokens.data_ptr(), seg.starts.data_ptr()
            args.seg_slot, args.seg_rank, args.n_seg = seg.slots.data_ptr(), seg.ranks.data_ptr(), seg.n
            keep.append(seg)
        return keep

    def accepts(self, meta, lora) -> bool:
        """Every step whose adapters (a LoraBatch) the C kernels cover (for_decoder)."""
        return lora is None or lora.for_decoder() is not None

    def _set_dora(self, args: _Args, dora) -> list:
        """Fill args' DoRA fields from the step's DoraRows (kernels/backend.py); returns what must stay alive."""
        assert dora.storage.dtype == torch.bfloat16 and dora.offs.dtype == torch.int64 and dora.offs.is_contiguous()
        rows = (ctypes.c_void_p * (self.num_layers * len(GROUPS)))()
        for (layer, group), i in dora.index.items():
            rows[layer * len(GROUPS) + GROUPS.index(group)] = dora.offs[i].data_ptr()
        args.dora_base, args.dora = dora.storage.data_ptr(), ctypes.addressof(rows)
        return [rows, dora.offs]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, lora=None,
            local: tuple | None = None, dora=None) -> torch.Tensor:
        """x: [T, H] bf16 contiguous (the embeddings), updated in place to the residual stream after the last
        layer's attention and MLP but before its residual add, which is returned ([T, H]: the caller adds it,
        as the layer loop does). cos, sin: [T, d]; meta: the step's AttentionMetadata (the paired layout:
        every token a row of decode_block_tables / decode_lens). lora: the step's LoraBatch (None: none),
        which accepts() took. local: the sliding layers' own (cos, sin) [T, d], or None. dora: the step's
        DoraRows (kernels/backend.py), or None: no DoRA row."""
        lora = lora.for_decoder() if lora is not None else None
        cfg = self.cfg
        t, hdim = x.shape
        assert x.is_contiguous() and x.dtype == torch.bfloat16 and hdim == cfg.hidden_size
        assert meta.num_decode == t and not meta.prefills
        cos, sin = cos.contiguous(), sin.contiguous()
        local = tuple(t.contiguous() for t in local) if local is not None else None
        tables = meta.decode_block_tables.to(torch.int64).contiguous()
        lens = meta.decode_lens.to(torch.int64).contiguous()
        pages = meta.slot_page.to(torch.int64).contiguous()
        offs = meta.slot_offset.to(torch.int64).contiguous()
        assert tables.shape[0] == lens.shape[0] == pages.shape[0] == offs.shape[0] == t
        q, kv, i2 = cfg.q_size, cfg.kv_size, 2 * cfg.intermediate_size
        new = lambda n: torch.empty(t, n, dtype=x.dtype)   # noqa: E731
        bufs = {"h": new(hdim), "qkv": new(q + 2 * kv), "attn": new(q), "o": new(hdim), "gate_up": new(i2),
                "act": new(i2 // 2), "down": new(hdim)}
        k = self.k_view
        args = _Args(self.num_layers, t, hdim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     k.shape[3], k.stride(0), tables.shape[1], cfg.rms_norm_eps, cfg.attn_scale or cfg.head_dim ** -0.5,
                     ctypes.addressof(self.layers), x.data_ptr(), *(b.data_ptr() for b in bufs.values()),
                     cos.data_ptr(), sin.data_ptr(), pages.data_ptr(), offs.data_ptr(), tables.data_ptr(),
                     lens.data_ptr())
        keep = self._set_lora(args, lora, t) if lora is not None else None   # noqa: F841 (alive until the call returns)
        kept = self._set_dora(args, dora) if dora is not None else None   # noqa: F841 (as keep)
        if local is not None:
            args.local_cos, args.local_sin = local[0].data_ptr(), local[1].data_ptr()
        args.softcap, args.gelu = cfg.attn_softcap, int(cfg.activation == "gelu_tanh")
        rc = _fn()(ctypes.addressof(args))
        if rc != 0:
            raise RuntimeError(f"decoder_layers_bf16 failed with code {rc}")
        return bufs["down"]
