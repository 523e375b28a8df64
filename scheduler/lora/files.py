"""Reading a LoRA adapter from disk and checking it against the served model.

Two formats are read, both a directory with an ``adapter_config.json``:

- mlx-lm's, as ``mlx_lm.lora`` writes it (``mlx_lm/tuner/utils.py`` ``load_adapters``):
  ``fine_tune_type`` (``lora`` or ``dora``), ``num_layers``, ``lora_parameters`` ``{rank,
  scale, dropout, keys}`` and ``adapters.safetensors`` with ``<module>.lora_a`` ``[in, r]``,
  ``<module>.lora_b`` ``[r, out]`` and, for DoRA, ``<module>.m`` ``[out]``. The update is
  ``scale * (x @ lora_a) @ lora_b`` (``tuner/lora.py``), DoRA's output is then rescaled per
  output channel by ``m / ||W + scale * lora_b.T @ lora_a.T||`` (``tuner/dora.py``).
- Hugging Face PEFT's: ``r``, ``lora_alpha``, ``target_modules`` (and ``use_rslora``,
  ``rank_pattern``, ``alpha_pattern``) with ``adapter_model.safetensors`` holding
  ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``;
  the scale is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), as PEFT's
  ``LoraLayer.update_layer`` sets it.

Everything is checked before anything is kept: each target must be a (quantized) linear
layer of this model with the adapter's input and output sizes, and the rank at most the
limit. A refusal raises :class:`AdapterError` naming what does not fit.

Reading is split in two so that the engine thread, which owns MLX arrays and the model,
does only the cheap part: :func:`read_files` (any thread: no MLX) reads the config and the
safetensors file into numpy arrays, :func:`check_adapter` (engine thread) makes them MLX
arrays and checks them against the model.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why (a 400)."""


@dataclass
class LayerUpdate:
    """One target layer's low-rank update.

    Attributes:
        a: ``[in, r]``; b: ``[r, out]`` (mlx-lm's orientation), in the file's dtype.
        scale: the update's factor (a float).
        magnitude: DoRA's per-output-channel factor ``m / ||W + scale * b.T @ a.T||`` ``[out]``
            (float32), or None for plain LoRA.
    """

    a: mx.array
    b: mx.array
    scale: float
    magnitude: Optional[mx.array] = None


@dataclass
class AdapterWeights:
    """An adapter read and checked: its layers by module path (``model.layers.0.self_attn.q_proj``)."""

    path: str
    kind: str  # "mlx-lm lora", "mlx-lm dora" or "peft lora"
    rank: int
    layers: dict[str, LayerUpdate]

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return sum(u.a.nbytes + u.b.nbytes + (u.magnitude.nbytes if u.magnitude is not None else 0)
                   for u in self.layers.values())


def linear_shape(layer) -> Optional[tuple[int, int]]:
    """``(in, out)`` of an ``nn.Linear`` or ``nn.QuantizedLinear`` (None for other layers)."""
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer.weight.shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, inp = layer.weight.shape
        return inp, out
    return None


def dense_weight(layer) -> mx.array:
    """The ``[out, in]`` weight of a linear layer, dequantized if it is quantized."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                             bits=layer.bits, mode=layer.mode)
    return layer.weight


def _config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter path {str(path)!r} is not a directory")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path.name}: no adapter_config.json") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path.name}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path.name}: adapter_config.json is not an object")
    return config


# safetensors dtypes as numpy reads them; BF16 (which numpy lacks) as its bits, uint16.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


@dataclass
class AdapterFiles:
    """An adapter as read from its directory, before any check (no MLX arrays: any thread).

    Attributes:
        path: its directory, as given.
        root: the same as a path.
        config: ``adapter_config.json``.
        tensors: the safetensors file's arrays (numpy; ``bfloat16`` ones as their bits, ``uint16``).
        bfloat16: names of the tensors that are ``bfloat16``.
    """

    path: str
    root: Path
    config: dict
    tensors: dict[str, np.ndarray]
    bfloat16: frozenset = field(default_factory=frozenset)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(t.nbytes for t in self.tensors.values())


def _safetensors(file: Path) -> tuple[dict[str, np.ndarray], frozenset]:
    """A safetensors file's tensors as numpy arrays (the format: an 8-byte little-endian
    header size, a JSON header of ``{name: {dtype, shape, data_offsets}}``, the data;
    huggingface/safetensors' README). Read here rather than with ``safetensors.numpy``,
    which refuses ``bfloat16``, the dtype ``mlx_lm.lora`` often saves.

    Raises:
        AdapterError: no such file, or not a readable safetensors file.
    """
    where = f"{file.parent.name}/{file.name}"
    if not file.is_file():
        raise AdapterError(f"{file.parent.name}: no {file.name}")
    try:
        data = file.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        body = memoryview(data)[8 + n:]
        out, bf16 = {}, set()
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[info["dtype"]]
            start, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if not 0 <= start <= end <= len(body):
                raise ValueError(f"{name}: data_offsets {start}-{end} past the file's end")
            out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
            if info["dtype"] == "BF16":
                bf16.add(name)
        return out, frozenset(bf16)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:  # truncated or foreign
        raise AdapterError(f"{where} is not a readable safetensors file ({e!r})") from None


def read_files(path: str) -> AdapterFiles:
    """Read the adapter directory ``path``: its config and tensors (any thread; no MLX).

    Raises:
        AdapterError: not a directory, no or a malformed ``adapter_config.json``, a config of
            neither format, no or an unreadable safetensors file.
    """
    root = Path(path)
    config = _config(root)
    if "lora_parameters" in config or "fine_tune_type" in config:
        file = root / "adapters.safetensors"
    elif "r" in config:
        file = root / "adapter_model.safetensors"
    else:
        raise AdapterError("adapter_config.json is neither mlx-lm's (lora_parameters) nor PEFT's (r, lora_alpha)")
    tensors, bf16 = _safetensors(file)
    return AdapterFiles(path, root, config, tensors, bf16)


def _mx(files: AdapterFiles) -> dict[str, mx.array]:
    """The tensors as MLX arrays (engine thread)."""
    return {k: mx.array(v).view(mx.bfloat16) if k in files.bfloat16 else mx.array(v)
            for k, v in files.tensors.items()}


def _number(config: dict, key: str, where: str) -> float:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise AdapterError(f"adapter_config.json: {where}{key} must be a number, got {v!r}")
    return float(v)


def _mlx_lm_pairs(config: dict, tensors: dict[str, mx.array], model) -> tuple[str, dict]:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"fine_tune_type {kind!r} is not an adapter (lora or dora only)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError("adapter_config.json: lora_parameters must be an object")
    scale = _number(params, "scale", "lora_parameters.")
    num_layers = config.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise AdapterError(f"adapter_config.json: num_layers must be an integer, got {num_layers!r}")
    allowed = _mlx_lm_targets(model, num_layers, params.get("keys"))
    pairs: dict[str, dict] = {}
    for key, w in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m") or (leaf == "m" and kind != "dora"):
            raise AdapterError(f"{key}: not an adapter tensor (lora_a, lora_b{', m' if kind == 'dora' else ''})")
        if module not in allowed:
            raise AdapterError(f"{key}: {module} is not a layer this adapter's config adapts in this model "
                               "(an adapter for another architecture?)")
        pairs.setdefault(module, {"scale": scale})[leaf] = w
    for module, p in pairs.items():
        if "lora_a" not in p or "lora_b" not in p:
            raise AdapterError(f"{module}: needs both lora_a and lora_b")
    return f"mlx-lm {kind}", pairs


def _mlx_lm_targets(model, num_layers: int, keys) -> set[str]:
    """The module paths mlx-lm's ``linear_to_lora_layers`` would adapt."""
    names = {id(m): name for name, m in model.named_modules()}
    targets: set[str] = set()
    layers = list(model.layers)
    for layer in layers[-max(num_layers, 0):] if num_layers > 0 else []:
        prefix = names.get(id(layer), "")
        for k, m in layer.named_modules():
            if (k in keys) if keys is not None else (linear_shape(_base(m)) is not None):
                targets.add(f"{prefix}.{k}" if prefix else k)
    if keys is not None:
        targets |= {name for name, _ in model.named_modules() if name in keys}
    return targets


def _peft_pairs(config: dict, tensors: dict[str, mx.array]) -> tuple[str, dict]:
    if config.get("use_dora"):
        raise AdapterError("PEFT DoRA adapters (use_dora) are not supported; mlx-lm's DoRA format is")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out adapters (Conv1D bases such as GPT-2) are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"PEFT bias={config.get('bias')!r} is not supported (only 'none')")
    r = _number(config, "r", "")
    alpha = _number(config, "lora_alpha", "")
    rslora = bool(config.get("use_rslora"))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    pairs: dict[str, dict] = {}
    for key, w in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.default)?\.weight", key)
        if m is None:
            raise AdapterError(f"{key}: not a LoRA tensor (only lora_A/lora_B weights; no modules_to_save)")
        module, leaf = m.group(1), m.group(2)
        rank = _pattern(rank_pattern, module, r)
        scale = _pattern(alpha_pattern, module, alpha) / (math.sqrt(rank) if rslora else rank)
        p = pairs.setdefault(module, {"scale": scale})
        if w.ndim != 2:
            raise AdapterError(f"{key}: expected a matrix, got shape {list(w.shape)}")
        p["lora_a" if leaf == "lora_A" else "lora_b"] = w.T  # PEFT's [r, in] / [out, r]
    for module, p in pairs.items():
        if "lora_a" not in p or "lora_b" not in p:
            raise AdapterError(f"{module}: needs both lora_A and lora_B")
    return "peft lora", pairs


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: a key matching the module's name or
    its dotted tail (``peft.utils.other.get_pattern_key``)."""
    for key, v in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(v)
    return default


def _mlx_name(model, modules: dict, module: str) -> str:
    """The MLX model's name of the Hugging Face module ``module`` (a PEFT adapter's names
    are the Hugging Face model's): itself when the MLX model has it, else the name the
    model's own ``sanitize`` gives its weight (mlx-lm's renames when it loads Hugging Face
    weights, e.g. qwen3_5's ``model.language_model.layers`` -> ``language_model.model.layers``)."""
    if module in modules or not hasattr(model, "sanitize"):
        return module
    try:
        renamed = list(model.sanitize({f"{module}.weight": mx.zeros((1, 1))}))
    except Exception:  # a sanitize that needs real weights: keep the name (refused below if absent)
        return module
    return renamed[0].removesuffix(".weight") if len(renamed) == 1 and renamed[0].endswith(".weight") else module


def _base(module):
    """The base layer of a wrapped (adapter-carrying) layer, or the module itself."""
    return getattr(module, "base_layer", module)


def check_adapter(files: AdapterFiles, model, max_rank: int) -> AdapterWeights:
    """Check the adapter read as ``files`` (either format) against ``model`` (engine thread).

    Args:
        files: from :func:`read_files`.
        model: the served mlx-lm model (layers already wrapped or not).
        max_rank: the largest rank accepted (``--max-lora-rank``).

    Returns:
        The checked adapter (DoRA magnitudes computed against the model's weights).

    Raises:
        AdapterError: malformed, for another model (a missing module or other shapes), a
            non-linear target, or a rank over ``max_rank``.
    """
    root, config = files.root, files.config
    if "lora_parameters" in config or "fine_tune_type" in config:
        kind, pairs = _mlx_lm_pairs(config, _mx(files), model)
    else:
        kind, pairs = _peft_pairs(config, _mx(files))
    if not pairs:
        raise AdapterError(f"{root.name}: the adapter has no tensors")
    modules = dict(model.named_modules())
    if kind == "peft lora":
        pairs = {_mlx_name(model, modules, m): p for m, p in pairs.items()}
    layers: dict[str, LayerUpdate] = {}
    rank = 0
    for module, p in sorted(pairs.items()):
        layer = modules.get(module)
        if layer is None:
            raise AdapterError(f"{module}: no such layer in this model (an adapter for another architecture?)")
        shape = linear_shape(_base(layer))
        if shape is None:
            raise AdapterError(f"{module}: a {type(_base(layer)).__name__}, not a linear layer "
                               "(only linear layers take adapters here)")
        a, b = p["lora_a"], p["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"{module}: A {list(a.shape)} and B {list(b.shape)} are not [in, r] and [r, out]")
        if (a.shape[0], b.shape[1]) != shape:
            raise AdapterError(f"{module}: the adapter maps {a.shape[0]} -> {b.shape[1]} features, this "
                               f"model's layer {shape[0]} -> {shape[1]} (an adapter for another base model?)")
        r = a.shape[1]
        if r > max_rank:
            raise AdapterError(f"{module}: rank {r} is over the limit of {max_rank} (--max-lora-rank)")
        rank = max(rank, r)
        magnitude = None
        if kind == "mlx-lm dora":
            w = dense_weight(_base(layer))
            m = p.get("m", mx.linalg.norm(w.astype(mx.float32), axis=1))
            if m.shape != (shape[1],):
                raise AdapterError(f"{module}.m: shape {list(m.shape)}, the layer has {shape[1]} outputs")
            adapted = w + (p["scale"] * b.T) @ a.T
            magnitude = (m / mx.linalg.norm(adapted, axis=1)).astype(mx.float32)
        layers[module] = LayerUpdate(a, b, p["scale"], magnitude)
    mx.eval([(u.a, u.b, u.magnitude) for u in layers.values()])
    return AdapterWeights(str(root), kind, rank, layers)
