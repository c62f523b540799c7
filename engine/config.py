"""Frozen configuration of each engine component. Derived values are properties.

`EngineConfig` gathers the others; it is built once by `EngineConfig.create(**kwargs)` from the
vLLM-style keyword arguments that `LLM(...)` and the CLI accept.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name in (torch.bfloat16, torch.float32):
            return name
        raise ValueError(f"dtype: {name} is not supported; use bfloat16 or float32")
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; use 'bfloat16' or 'float32'") from None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture read from a Hugging Face `config.json`: the shared decoder layer's sizes and its
    family's switches (engine/model/family.py)."""
    path: str
    name: str
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_model_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    family: str = "llama"
    qkv_bias: bool = False                  # q, k, v projections have biases
    qk_norm: bool = False                   # RMSNorm of each q and k head before RoPE
    fused_projections: bool = False         # qkv_proj / gate_up_proj in the checkpoint and its adapters
    layer_windows: tuple[int, ...] = ()     # keys each layer's tokens attend to (0 or absent: all)
    local_rope_theta: float = 0.0           # the sliding layers' own RoPE (Gemma 3); 0: rope_theta's
    local_rope_scaling: dict | None = None
    norm_offset: bool = False               # Gemma: RMSNorm weights applied as 1 + w
    sandwich_norms: bool = False            # Gemma: attention and MLP outputs normed before their adds
    activation: str = "silu"                # "silu" or "gelu_tanh"
    embed_scale: bool = False               # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float = 0.0                 # 0: head_dim ** -0.5
    attn_softcap: float = 0.0               # Gemma 2: scores -> cap * tanh(score / cap); 0: none
    final_softcap: float = 0.0              # Gemma 2: the logits likewise
    moe: object = None                      # engine.model.family.MoeSpec: a mixture-of-experts MLP, or None

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype, name: str | None = None,
                 max_model_len: int | None = None) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model: {path} has no config.json (not a Hugging Face model directory)")
        from engine.model.family import describe
        cfg = json.loads(cfg_file.read_text())
        switches = describe(cfg, str(cfg_file))
        theta, scaling = switches.rope
        local_theta, local_scaling = switches.local_rope or (0.0, None)
        heads = cfg["num_attention_heads"]
        model_len = cfg.get("max_position_embeddings", 2048)
        return cls(
            path=str(path), name=name or path.name, dtype=dtype, vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_model_len=min(model_len, max_model_len or model_len),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=_eos_ids(path, cfg), family=switches.family, qkv_bias=switches.qkv_bias,
            qk_norm=switches.qk_norm, fused_projections=switches.fused_projections,
            layer_windows=switches.layer_windows, local_rope_theta=local_theta, local_rope_scaling=local_scaling,
            norm_offset=switches.norm_offset, sandwich_norms=switches.sandwich_norms,
            activation=switches.activation, embed_scale=switches.embed_scale, attn_scale=switches.attn_scale or 0.0,
            attn_softcap=switches.attn_softcap, final_softcap=switches.final_softcap, moe=switches.moe)


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    for source in (cfg, json.loads(gen.read_text()) if gen.is_file() else {}):
        eos = source.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    """The paged pool: fixed-size pages shared by KV blocks (and, later, adapter weights).

    block_size 32 by default: decode attention reads each sequence's K/V block by block from scattered
    pages, and 12 KB blocks (16 tokens) read slower than 24 KB ones (measured here, 64 rows x 192 tokens:
    388 -> 319 us a layer; the engine benchmark 6% faster; 64 would save 5% more but would leave a
    rank-16 q/v adapter 40% of its pages unused)."""
    block_size: int = 32
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    long_prefill_token_threshold: int = 512
    scheduling_policy: str = "vtc"     # "vtc", "fair" or "fcfs" (see engine/waiting_queue.py)


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA limits, named as vLLM's flags.

    max_loras: distinct adapters in one step. None (the default): as many as the pool holds, on every
    backend (the CPU and Triton backends read adapters in place in the pool's pages; the reference
    backend's slots grow). max_lora_rank: the largest rank
    accepted; max_cpu_loras / max_cpu_lora_bytes: the host-memory tier between disk and the page pool;
    loader_threads: the threads that load adapters beside the step (engine/lora/loader.py); host_tier_dtype:
    "auto" (the model's dtype) or "int8" (engine/lora/int8_pages.py: half the bytes of bf16, lossy);
    max_adapters_per_request: adapters one request may compose (engine/lora/compose.py)."""
    enable_lora: bool = True
    max_loras: int | None = None
    max_lora_rank: int = 64
    max_cpu_loras: int = 64
    max_cpu_lora_bytes: int = 4 << 30
    starvation_steps: int = 64
    loader_threads: int = 1
    host_tier_dtype: str = "auto"
    max_adapters_per_request: int = 4


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0
    backend: str = "auto"     # the compute backend (kernels/selector.py): auto, torch, cpu or triton
    device: str = "auto"      # auto (CUDA when torch sees one), cpu or cuda

    @classmethod
    def create(cls, model: str = "default", dtype: str | torch.dtype = "bfloat16",
               max_model_len: int | None = None, seed: int = 0, backend: str = "auto", device: str = "auto",
               **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments; unknown names raise a ValueError naming them."""
        from engine.model.resolve import resolve_model
        path, name = resolve_model(model)
        parts = {}
        for part_cls in (CacheConfig, SchedulerConfig, LoraConfig):
            names = {f.name for f in fields(part_cls)}
            parts[part_cls] = part_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
        model_cfg = ModelConfig.from_dir(path, parse_dtype(dtype), name, max_model_len)
        cfg = cls(model=model_cfg, cache=parts[CacheConfig], scheduler=parts[SchedulerConfig],
                  lora=parts[LoraConfig], seed=seed, backend=backend, device=device)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        s, c, lo = self.scheduler, self.cache, self.lora
        max_loras = 1 if lo.max_loras is None else lo.max_loras
        for name, value in (("max_loras", max_loras), ("max_lora_rank", lo.max_lora_rank),
                            ("max_cpu_loras", lo.max_cpu_loras), ("loader_threads", lo.loader_threads),
                            ("max_adapters_per_request", lo.max_adapters_per_request),
                            ("max_num_seqs", s.max_num_seqs),
                            ("max_num_batched_tokens", s.max_num_batched_tokens),
                            ("block_size", c.block_size), ("kv_cache_memory_bytes", c.kv_cache_memory_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        from engine.lora.int8_pages import HOST_TIER_DTYPES
        from engine.waiting_queue import policy_class
        from kernels.selector import BACKENDS, resolve_device
        if lo.host_tier_dtype not in HOST_TIER_DTYPES:
            raise ValueError(f"host_tier_dtype must be one of {', '.join(HOST_TIER_DTYPES)}, "
                             f"got {lo.host_tier_dtype!r}")
        policy_class(s.scheduling_policy)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        resolve_device(self.device)
