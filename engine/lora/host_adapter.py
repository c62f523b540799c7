"""An adapter's files, validated against the base model in two stages.

`describe_adapter` reads adapter_config.json and the safetensors header only (tensor names, dtypes and
shapes; no weights) and refuses everything loraplex cannot apply, naming it. It costs 2-3 ms here
whatever the adapter's size (~0.1 ms for a header already described: adapters of one recipe share theirs),
so a refusal is told at once and its `AdapterFiles` plans the adapter's pages.
`read_weights` then reads the weights (memory-mapped), converts them to the model dtype and refuses NaN and
infinite values; the loader (engine/lora/loader.py) runs it off the step thread.
`HostAdapter.modules[(layer, module)] = LoraModule(A [r, in], B [out, r], scale)` in the model dtype.
Only safetensors are read; pickled `.bin` weights are refused.

An adapter of a fused checkpoint (Phi-3: `qkv_proj`, `gate_up_proj`) becomes the kernels' projections
here: q, k and v each take the fused module's A and their own rows of its B (B @ (A x) row by row is
each projection's delta exactly), so nothing after this file knows fused modules.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.lora.peft_config import FUSED, LoraSpec, model_modules, module_path, read_spec
from kernels.lora_layout import is_expert

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")
# PEFT's LoRA of a mixture-of-experts layer's stacked expert weights (target_parameters): one wrapper per
# parameter, nested on the experts module, so the keys name the nesting depth, not the parameter
_EXPERT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                         r"lora_([AB])(?:\.\w+)?\.weight$")
# DoRA's magnitude vector of a projection ([out]; saved without ".weight" by PEFT 0.21)
_MAG_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                      r"\.lora_magnitude_vector(?:\.\w+)?(?:\.weight)?$")
# safetensors dtype names that are floating point (what torch's is_floating_point accepts)
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ITEMSIZE = {name: t.itemsize for name, t in _TORCH_DTYPES.items()}
_FLOAT_DTYPES = set(_TORCH_DTYPES)
_MAX_HEADER = 100 << 20          # safetensors' own limit on the JSON header


@dataclass
class LoraModule:
    a: torch.Tensor      # [r, in]
    b: torch.Tensor      # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class HostAdapter:
    modules: dict[tuple[int, str], LoraModule]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    def ranks(self) -> dict[tuple[int, str], int]:
        return {k: m.rank for k, m in self.modules.items()}

    def module_shapes(self) -> dict[tuple[int, str], tuple[int, int, int, float]]:
        """(layer, module) -> (rank, in, out, scale), what plans the adapter's pages."""
        return {k: (m.rank, m.a.shape[1], m.b.shape[0], m.scale) for k, m in self.modules.items()}


@dataclass(frozen=True)
class AdapterFiles:
    """What `describe_adapter` found: enough to plan the pages and to read the weights later."""
    path: Path
    spec: LoraSpec
    weights: Path
    keys: dict[tuple[int, str], tuple[str, str]]                 # (layer, module) -> names of A and B
    where: dict[tuple[int, str], tuple[tuple[str, int, int], ...]]  # -> (dtype, first, end byte) of A, B
    shapes: dict[tuple[int, str], tuple[int, int, int, float]]    # (layer, module) -> (rank, in, out, scale)
    signature: tuple[int, ...]                                    # the files' sizes and mtimes
    rows: dict[tuple[int, str], tuple[int, int]] = dataclasses.field(default_factory=dict)
    # a piece of a fused module -> the rows [first, end) of the fused B that are its B
    magnitudes: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)
    header_sha256: bytes = b""                                    # of the safetensors header's JSON bytes
    # DoRA (spec.use_dora): (layer, module) -> the name of its magnitude vector (a fused module's pieces:
    # their rows of it, `rows`)

    def module_shapes(self) -> dict[tuple[int, str], tuple[int, int, int, float]]:
        return self.shapes

    @property
    def nbytes(self) -> int:
        """The weights file's size."""
        return self.signature[2]


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a projection (or of a fused module: its pieces' outputs together)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    if module in FUSED:
        parts = [module_shape(cfg, m) for m in FUSED[module]]
        return parts[0][0], sum(out for _, out in parts)
    return {"q_proj": (H, cfg.q_size), "k_proj": (H, cfg.kv_size), "v_proj": (H, cfg.kv_size),
            "o_proj": (cfg.q_size, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}[module]


def weights_file(adapter_dir: str | Path) -> Path:
    d = Path(adapter_dir)
    f = d / "adapter_model.safetensors"
    if not f.is_file():
        if (d / "adapter_model.bin").is_file():
            raise ValueError(f"adapter: {d} has only pickled adapter_model.bin; loraplex loads safetensors only")
        raise ValueError(f"adapter: {d} has no adapter_model.safetensors")
    return f


def files_signature(adapter_dir: str | Path) -> tuple[int, ...]:
    """(config size, config mtime, weights size, weights mtime) in ns; zeros for a missing file. Two equal
    signatures mean the folder was not changed in between (as make and rsync judge it)."""
    d = Path(adapter_dir)
    out: list[int] = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = (d / name).stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [0, 0]
    return tuple(out)


def _header_bytes(f: Path) -> bytes:
    """The safetensors header's JSON bytes (no weights read)."""
    try:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 2 <= n <= _MAX_HEADER:
                raise ValueError("bad header length")
            data = fh.read(n)
        if len(data) != n:
            raise ValueError("the file ends inside its header")
        return data
    except ValueError as e:
        raise ValueError(f"adapter: {f} is not a valid safetensors file: {e}") from None


def _parse_header(f: Path, data: bytes) -> dict[str, dict]:
    try:
        header = msgspec.json.decode(data)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError, msgspec.DecodeError) as e:
        raise ValueError(f"adapter: {f} is not a valid safetensors file: {e}") from None
    header.pop("__metadata__", None)
    for info in header.values():
        if not isinstance(info, dict):
            raise ValueError(f"adapter: {f} is not a valid safetensors file: a tensor entry is not an object")
        begin, end = (info.get("data_offsets") or [0, 0])[:2]
        info["start"], info["end"] = 8 + len(data) + int(begin), 8 + len(data) + int(end)
    return header


def read_header(f: Path) -> dict[str, dict]:
    """The safetensors header: tensor name -> {"dtype", "shape", "data_offsets"} (no weights read), the
    offsets made relative to the file's first byte (`start`)."""
    return _parse_header(f, _header_bytes(f))


class _Described(NamedTuple):
    cfg: ModelConfig                              # the base model it was checked against (compared by identity)
    keys: dict
    where: dict
    shapes: dict
    rows: dict
    magnitudes: dict
    header_sha256: bytes


# What describe_adapter found for a header: adapters trained by one recipe share their header bytes (names,
# dtypes, shapes, offsets), and the Python walk over a few hundred tensors is most of a cold load's
# registration (~3 ms), so a header already described is looked up instead. Keyed by everything the walk
# reads: the header bytes, the LoRA settings, the file's size, max_rank and the model config.
_DESCRIBED: OrderedDict[tuple, _Described] = OrderedDict()
_DESCRIBED_MAX = 64
_MAX_CACHED_HEADER = 1 << 20
_described_lock = threading.Lock()


def _remembered(key: tuple, cfg: ModelConfig) -> _Described | None:
    with _described_lock:
        hit = _DESCRIBED.get(key)
        if hit is None or hit.cfg is not cfg:
            return None
        _DESCRIBED.move_to_end(key)
        return hit


def _remember(key: tuple, value: _Described) -> None:
    if len(key[0]) > _MAX_CACHED_HEADER:
        return
    with _described_lock:
        _DESCRIBED[key] = value
        while len(_DESCRIBED) > _DESCRIBED_MAX:
            _DESCRIBED.popitem(last=False)


def describe_adapter(adapter_dir: str | Path, cfg: ModelConfig, max_rank: int,
                     spec: LoraSpec | None = None) -> AdapterFiles:
    """Validate an adapter's config and the names, dtypes and shapes of its weights; read no weights."""
    d = Path(adapter_dir)
    signature = files_signature(d)
    spec = spec or read_spec(d)
    f = weights_file(d)
    data = _header_bytes(f)
    cache_key = (data, repr(spec), max_rank, signature[2])
    hit = _remembered(cache_key, cfg)
    if hit is not None:          # copies: an AdapterFiles owns its tables
        return AdapterFiles(d, spec, f, dict(hit.keys), dict(hit.where), dict(hit.shapes), signature,
                            dict(hit.rows), dict(hit.magnitudes), hit.header_sha256)
    files = _describe(d, f, _parse_header(f, data), signature, spec, cfg, max_rank)
    files = dataclasses.replace(files, header_sha256=hashlib.sha256(data).digest())
    _remember(cache_key, _Described(cfg, dict(files.keys), dict(files.where), dict(files.shapes),
                                    dict(files.rows), dict(files.magnitudes), files.header_sha256))
    return files


def _describe(d: Path, f: Path, header: dict[str, dict], signature: tuple[int, ...], spec: LoraSpec,
              cfg: ModelConfig, max_rank: int) -> AdapterFiles:
    """describe_adapter's walk over the header's tensors (raises ValueError naming what does not fit)."""
    served = model_modules(cfg.fused_projections, cfg.moe is not None)
    parts: dict[tuple[int, str], dict[str, tuple[str, dict]]] = {}
    mags: dict[tuple[int, str], tuple[str, dict]] = {}
    nested: dict[tuple[int, int], dict[str, tuple[str, dict]]] = {}     # (layer, depth) -> an expert LoRA
    for key, info in header.items():
        e = _EXPERT_KEY.match(key)
        if e:
            nested.setdefault((int(e.group(1)), e.group(2).count(".")), {})[e.group(3)] = (key, info)
            continue
        g = _MAG_KEY.match(key)
        if g and spec.use_dora and int(g.group(1)) < cfg.num_layers and g.group(2) in served:
            mags[(int(g.group(1)), g.group(2))] = (key, info)
            continue
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"adapter: weight {key!r} is not supported (only LoRA A/B of "
                             f"{', '.join(served)}; no embedding or lm_head LoRA)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in served or layer >= cfg.num_layers:
            raise ValueError(f"adapter: weight {key!r} does not fit the base model "
                             f"({cfg.num_layers} layers, modules {', '.join(served)})")
        parts.setdefault((layer, module), {})[ab] = (key, info)
    parts.update(_expert_parts(nested, spec, cfg))
    if not parts:
        raise ValueError(f"adapter: {f} holds no LoRA weights")
    missing = sorted(set(spec.expected_modules(cfg.num_layers, served)) - set(parts))
    if missing:
        layer, module = missing[0]
        raise ValueError(f"adapter: target_modules names {module} but {module_path(layer, module)} has no "
                         f"weights ({len(missing)} such modules missing)")
    keys, shapes, where, rows = {}, {}, {}, {}
    dims = {m: module_shape(cfg, m) for m in served}
    uniform = None if spec.rank_pattern or spec.alpha_pattern else (spec.r, spec.scale_for(""))
    if cfg.moe is not None:
        E, inter = cfg.moe.num_experts, cfg.moe.intermediate
        dims |= {"experts.gate_up_proj": (cfg.hidden_size, 2 * inter), "experts.down_proj": (inter, cfg.hidden_size)}
    for (layer, module), ab in sorted(parts.items()):
        if is_expert(module):                   # rank E * r: every expert's r rows (kernels/lora_layout.py)
            if spec.r > max_rank:
                raise ValueError(f"adapter: rank {spec.r} of {module_path(layer, module)} is above "
                                 f"max_lora_rank={max_rank}")
            r, n_in, _, scale = _check_module(dims[module], spec, (E * spec.r, spec.scale_for("")), layer, module,
                                              ab, E * max_rank)
        else:
            r, n_in, _, scale = _check_module(dims[module], spec, uniform, layer, module, ab, max_rank)
        for key, info in ab.values():
            _check_extent(f, key, info, signature[2])
        a_at, b_at = ((ab[x][1]["dtype"], ab[x][1]["start"], ab[x][1]["end"]) for x in "AB")
        first = 0
        for piece in FUSED.get(module, (module,)):      # a fused module: its projections, in row order
            n = dims[piece][1] if is_expert(piece) else module_shape(cfg, piece)[1]
            row_bytes = r * _ITEMSIZE[b_at[0]]
            keys[(layer, piece)] = (ab["A"][0], ab["B"][0])
            shapes[(layer, piece)] = (r, n_in, n, scale)
            where[(layer, piece)] = (a_at, (b_at[0], b_at[1] + first * row_bytes, b_at[1] + (first + n) * row_bytes))
            if module in FUSED:
                rows[(layer, piece)] = (first, first + n)
            first += n
    magnitudes = _magnitudes(mags, parts, dims, f, signature[2], spec.use_dora)
    magnitudes = {(layer, piece): magnitudes[(layer, module)] for (layer, module) in parts
                  for piece in FUSED.get(module, (module,)) if (layer, module) in magnitudes}
    return AdapterFiles(d, spec, f, keys, where, shapes, signature, rows, magnitudes)


def _magnitudes(mags: dict, parts: dict, dims: dict, f: Path, file_size: int, use_dora: bool) -> dict:
    """DoRA: every adapted module has a float magnitude vector [out] and nothing else has one ->
    (layer, module) -> its name. Without use_dora there is none (a magnitude key then fails _KEY)."""
    if not use_dora:
        return {}
    missing = sorted(set(parts) - set(mags))
    if missing:
        raise ValueError(f"adapter: use_dora is set but {module_path(*missing[0])} has no lora_magnitude_vector "
                         f"({len(missing)} such modules)")
    extra = sorted(set(mags) - set(parts))
    if extra:
        raise ValueError(f"adapter: {module_path(*extra[0])} has a lora_magnitude_vector but no lora_A / lora_B")
    for (layer, module), (key, info) in mags.items():
        n_out = dims[module][1]
        if tuple(info.get("shape", ())) != (n_out,) or info.get("dtype") not in _FLOAT_DTYPES:
            raise ValueError(f"adapter: {module_path(layer, module)}.lora_magnitude_vector is {info.get('dtype')} "
                             f"{tuple(info.get('shape', ()))}; DoRA needs floating point ({n_out},)")
        _check_extent(f, key, info, file_size)
    return {k: key for k, (key, _) in mags.items()}


def _expert_parts(nested: dict, spec: LoraSpec, cfg: ModelConfig) -> dict[tuple[int, str], dict]:
    """(layer, depth) -> its A and B  =>  (layer, expert module) -> its A and B. Which parameter a wrapper
    adapts is told by its shapes: gate_up_proj's A is [E r, hidden] and B [2 inter, E r], down_proj's A
    [E r, inter] and B [hidden, E r] (never both: that would need inter = 0)."""
    if not nested and not spec.target_parameters:
        return {}
    if cfg.moe is None:
        raise ValueError("adapter: it adapts experts (target_parameters) but the base model has none")
    H, inter = cfg.hidden_size, cfg.moe.intermediate
    by_dims = {(H, 2 * inter): "experts.gate_up_proj", (inter, H): "experts.down_proj"}
    out: dict[tuple[int, str], dict] = {}
    for (layer, _), ab in sorted(nested.items()):
        if len(ab) != 2:
            raise ValueError(f"adapter: layer {layer}'s experts have lora_{''.join(ab)} but not both A and B")
        a, b = tuple(ab["A"][1].get("shape", ())), tuple(ab["B"][1].get("shape", ()))
        module = by_dims.get((a[-1] if a else -1, b[0] if b else -1))
        if module is None or layer >= cfg.num_layers or not cfg.moe.sparse[layer] or (layer, module) in out:
            raise ValueError(f"adapter: the expert LoRA {ab['A'][0]!r} (A {a}, B {b}) does not fit the base model "
                             f"(experts on layers {[i for i, x in enumerate(cfg.moe.sparse) if x]}, gate_up_proj "
                             f"[{2 * inter}, {H}], down_proj [{H}, {inter}] per expert)")
        out[(layer, module)] = ab
    layers = spec.layers if spec.layers is not None else range(cfg.num_layers)
    missing = [(i, p) for p in spec.target_parameters for i in layers if cfg.moe.sparse[i] and (i, p) not in out]
    if missing:
        layer, module = missing[0]
        raise ValueError(f"adapter: target_parameters names {module} but {module_path(layer, module)} has no "
                         f"weights ({len(missing)} such missing)")
    return out


def _check_module(dims, spec, uniform, layer, module, ab, max_rank) -> tuple[int, int, int, float]:
    """dims: (in, out) of the module; uniform: (rank, scale) of every module when the config has no
    rank or alpha patterns (else each module's path is matched)."""
    if len(ab) != 2:
        raise ValueError(f"adapter: {module_path(layer, module)} has lora_{''.join(ab)} but not both A and B")
    (_, info_a), (_, info_b) = ab["A"], ab["B"]
    a, b = tuple(info_a.get("shape", ())), tuple(info_b.get("shape", ()))
    n_in, n_out = dims
    if uniform is None:
        path = module_path(layer, module)
        r, scale = spec.rank_for(path), spec.scale_for(path)
    else:
        r, scale = uniform
    if a != (r, n_in) or b != (n_out, r):
        raise ValueError(f"adapter: {module_path(layer, module)} has lora_A {a} and lora_B {b}; the base "
                         f"model and rank {r} need ({r}, {n_in}) and ({n_out}, {r}) (different base architecture?)")
    if r > max_rank:
        raise ValueError(f"adapter: rank {r} of {module_path(layer, module)} is above max_lora_rank={max_rank}")
    if info_a.get("dtype") not in _FLOAT_DTYPES or info_b.get("dtype") not in _FLOAT_DTYPES:
        name, info = ("lora_A", info_a) if info_a.get("dtype") not in _FLOAT_DTYPES else ("lora_B", info_b)
        raise ValueError(f"adapter: {module_path(layer, module)}.{name} is {info.get('dtype')}; LoRA weights must "
                         f"be floating point")
    return r, n_in, n_out, scale


def _check_extent(f: Path, key: str, info: dict, file_size: int) -> None:
    """The bytes a tensor's header entry names lie inside the file and hold exactly its shape."""
    n = 1
    for d in info.get("shape", ()):
        n *= int(d)
    if info["end"] - info["start"] != n * _ITEMSIZE[info["dtype"]] or not 0 < info["start"] <= info["end"] <= file_size:
        raise ValueError(f"adapter: {f} is not a valid safetensors file: {key!r} has data_offsets that do not fit "
                         f"its shape or the file")


def read_weights(files: AdapterFiles):
    """Yield ((layer, module), a [r, in], b [out, r]) for every module, read memory-mapped, in the file's
    dtype (the caller converts). Raises ValueError when the file no longer matches its description."""
    try:
        fh = safe_open(str(files.weights), framework="pt")
    except Exception as e:  # noqa: BLE001 - a corrupt file must name itself, whatever the parser raised
        raise ValueError(f"adapter: {files.weights} is not a valid safetensors file: {e}") from None
    with fh:
        for key, (ka, kb) in files.keys.items():
            try:
                a, b = fh.get_tensor(ka), fh.get_tensor(kb)
            except Exception as e:  # noqa: BLE001 - as above
                raise ValueError(f"adapter: {files.weights} cannot be read: {e}") from None
            r, n_in, n_out, _ = files.shapes[key]
            if key in files.rows:                  # a piece of a fused module: its rows of the fused B
                first, end = files.rows[key]
                b = b[first:end]
            if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r) or not a.is_floating_point() \
                    or not b.is_floating_point():
                raise ValueError(f"adapter: {files.weights} changed on disk since it was registered "
                                 f"({module_path(*key)} is not what its header said)")
            yield key, a, b


def mapped_weights(files: AdapterFiles):
    """Like read_weights, without a copy: ((layer, module), a [r, in], b [out, r]) as views of the weights file
    mapped copy-on-write (torch.from_file, private), in the file's dtype, for the caller to convert as it
    packs (a tensor whose bytes are not aligned to its dtype is copied first). Reading the tensors out with
    safetensors costs an allocation and a copy each: about half of packing an adapter for a GPU here.
    Raises ValueError when the file changed since it was described."""
    if files_signature(files.path) != files.signature:
        raise ValueError(f"adapter: {files.weights} changed on disk since it was registered")
    raw = torch.from_file(str(files.weights), shared=False, size=files.nbytes, dtype=torch.uint8)

    def tensor(dtype: str, first: int, end: int, shape: tuple[int, int]) -> torch.Tensor:
        t = _TORCH_DTYPES[dtype]
        part = raw[first:end] if first % t.itemsize == 0 else raw[first:end].clone()
        return part.view(t).view(shape)

    for key, ((da, sa, ea), (db, sb, eb)) in files.where.items():
        r, n_in, n_out, _ = files.shapes[key]
        yield key, tensor(da, sa, ea, (r, n_in)), tensor(db, sb, eb, (n_out, r))


def check_finite(key: tuple[int, str], name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """NaN, or beyond the model dtype's range: every output of this adapter's requests would be garbage.
    Told by the smallest and largest values (NaN propagates to both): one pass without a temporary, 20x
    faster than isfinite(t).all() on bf16 here (~0.2 vs 4.2 ms a million values)."""
    lo, hi = torch.aminmax(t)
    if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
        raise ValueError(f"adapter: {module_path(*key)}.{name} holds NaN or infinite values (in {dtype})")


def load_host_adapter(adapter_dir: str | Path, cfg: ModelConfig, max_rank: int,
                      spec: LoraSpec | None = None) -> HostAdapter:
    """Describe, read and validate an adapter into host memory (tests and tools; the engine's loader
    writes straight into the packed pages instead)."""
    files = describe_adapter(adapter_dir, cfg, max_rank, spec)
    modules = {}
    for key, a, b in read_weights(files):
        a, b = a.to(cfg.dtype).contiguous(), b.to(cfg.dtype).contiguous()
        check_finite(key, "lora_A", a, cfg.dtype)
        check_finite(key, "lora_B", b, cfg.dtype)
        modules[key] = LoraModule(a, b, files.shapes[key][3])
    return HostAdapter(modules)
