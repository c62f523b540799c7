"""Run every kind of step once before a server says it is ready, so that on a GPU each Triton kernel a step
launches is compiled then, not in the middle of serving (Triton compiles a kernel on its first launch):
a prefill chunk and decode steps of the base model and of a throwaway adapter on every projection, in one
batch, then DoRA's row scales for each projection group's width. Leaves no request, adapter or KV page in
use behind (the prompt's blocks may stay in the prefix cache under their own salt, as any finished
request's do)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora import dora
from engine.lora.host_adapter import module_shape
from engine.lora.peft_config import model_modules, module_path
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams
from kernels.lora_layout import GROUP_MODULES

NAME = "loraplex-warm-up"
SALT = "loraplex-warm-up"


def warm_up(core) -> None:
    """core: an EngineCore with nothing running."""
    block = core.cfg.cache.block_size
    prompt = [(7 * i + 11) % core.cfg.model.vocab_size for i in range(block + 3)]    # a full block and more
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="loraplex-warm-up-") as d:
        adapter = None
        if core.adapters is not None:
            write_adapter(Path(d), core.cfg.model, min(16, core.cfg.lora.max_lora_rank))
            core.register_adapter(NAME, d)
            core.prefetch_adapter(NAME)          # loaded before the first step, so that both rows share
            core.adapters.wait_loads()           # the batch (else a fast base row may finish alone)
            adapter = NAME
        try:
            for i, name in enumerate((None, adapter) if adapter else (None,)):
                core.add_request(GenerateRequest(f"{NAME}-{i}", prompt, params, adapter=name, cache_salt=SALT))
            while core.has_unfinished():
                core.step()
        finally:
            if adapter:
                core.unregister_adapter(NAME)
            core.settle()
    if core.adapters is not None:
        warm_dora(core)


def warm_dora(core) -> None:
    """DoRA's row scales (Backend.dora_scale) once for each projection group's width, on one row that no
    adapter scales (offset -1): its kernel compiled, nothing touched. (A DoRA warm-up adapter would need
    magnitudes that no zero row of W makes infinite.)"""
    storage = core.runner.storage
    none = torch.full((1,), -1, dtype=torch.int64, device=storage.device)
    for n in sorted({dora.group_size(core.cfg.model, g) for g in GROUP_MODULES}):
        core.runner.backend.dora_scale(torch.zeros(1, n, dtype=storage.dtype, device=storage.device), storage, none)


def write_adapter(d: Path, model, rank: int) -> None:
    """A PEFT adapter of zeros on every projection of every layer (its values do not matter here)."""
    tensors, modules = {}, model_modules(model.fused_projections, model.moe is not None)
    for layer in range(model.num_layers):
        for m in modules:
            n_in, n_out = module_shape(model, m)
            key = f"base_model.model.{module_path(layer, m)}"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(rank, n_in, dtype=torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(n_out, rank, dtype=torch.bfloat16)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                       "target_modules": list(modules), "bias": "none"}))
