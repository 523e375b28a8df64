"""Convert a llama-architecture GGUF file into an MLX model directory that ``mlx_lm.load`` opens.

``mx.load`` reads GGUF tensors: Q4_0, Q4_1 and Q8_0 come back in MLX's affine quantized
form (``name.weight`` packed uint32, ``name.scales``, ``name.biases``, groups of 32), F32
and F16 as they are, and BF16, Q2_K, Q4_K and Q6_K dequantized to float16. Other types
(Q5_*, Q3_K, Q5_K, IQ*, ...) are refused before loading, naming the tensor.

The output directory holds ``config.json`` (mlx_lm's ``llama`` model with
``rope_traditional: true``: llama.cpp stores q and k permuted for interleaved RoPE),
``model.safetensors`` (or ``model-0000N-of-0000M.safetensors`` shards), ``tokenizer.json``,
``tokenizer_config.json`` (see :mod:`gateway.models.gguf_tokenizer`) and ``gguf_source.json``
(what it was converted from). It is built in a temporary sibling directory, checked by
loading it with mlx_lm, and renamed into place, so a conversion that stops half way
leaves no directory behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gateway.models.gguf_tokenizer import GGUFTokenizerError, write_tokenizer

log = logging.getLogger("mlx_gateway.models.gguf")

CONVERTER_VERSION = 1

GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # stay quantized (MLX affine, group size 32)
FLOAT_TYPES = ("F32", "F16", "BF16")  # BF16 is read as float16
DEQUANTIZED_TYPES = ("Q2_K", "Q4_K", "Q6_K")  # MLX reads these as float16
SUPPORTED_TYPES = QUANTIZED_TYPES + FLOAT_TYPES + DEQUANTIZED_TYPES

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "scales", "biases", "bias")
SHARD_BYTES = 2 << 30  # bytes per safetensors file


class GGUFError(ValueError):
    """The GGUF file is unreadable, or holds an architecture, tensor, quantization type or
    tokenizer that the converter does not support. The message is one line."""


@dataclass
class TensorInfo:
    """One tensor of a GGUF file: ``shape`` in MLX order (rows first), ``type`` a GGML type name."""

    name: str
    shape: tuple[int, ...]
    type: str


@dataclass
class GGUFHeader:
    """A GGUF file's version, its scalar and string metadata (arrays are skipped, as None)
    and its tensors, in file order."""

    version: int
    metadata: dict
    tensors: list[TensorInfo]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read the header of the GGUF file at ``path`` without loading any tensor.

    Raises:
        GGUFError: not a GGUF file (version 2 or 3), or a truncated header.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        def take(fmt: str):
            data = f.read(struct.calcsize(fmt))
            if len(data) != struct.calcsize(fmt):
                raise GGUFError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            n = take("<Q")
            data = f.read(n)
            if len(data) != n:
                raise GGUFError(f"{path}: truncated GGUF header")
            return data.decode("utf-8", errors="replace")

        def value(kind: int, keep: bool = True):
            if kind == 8:
                return string()
            if kind == 9:
                item, n = take("<I"), take("<Q")
                if item in _SCALARS:  # fixed-size items: skip them in one seek
                    f.seek(n * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
                else:
                    for _ in range(n):
                        value(item, False)
                return None
            if kind not in _SCALARS:
                raise GGUFError(f"{path}: unknown GGUF metadata value type {kind}")
            return take(_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        version = take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = string()
            metadata[key] = value(take("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            kind = take("<I")
            take("<Q")  # data offset
            tensors.append(TensorInfo(name, tuple(reversed(dims)), GGML_TYPES.get(kind, f"type {kind}")))
    return GGUFHeader(version, metadata, tensors)


def check_supported(header: GGUFHeader) -> None:
    """Refuse what the converter cannot handle, naming it.

    Raises:
        GGUFError: ``general.architecture`` is not ``llama``; a tokenizer model other than
            ``gpt2`` or ``llama``; a mixture-of-experts or RoPE-scaling layout mlx_lm's llama
            cannot take; a tensor type MLX cannot load.
    """
    arch = header.metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"unsupported GGUF architecture {arch!r}: only 'llama' can be converted")
    tokenizer = header.metadata.get("tokenizer.ggml.model")
    if tokenizer not in ("gpt2", "llama"):
        raise GGUFError(f"unsupported GGUF tokenizer model {tokenizer!r} "
                        "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    names = {t.name for t in header.tensors}
    if header.metadata.get("llama.expert_count") or any("_exps." in n for n in names):
        raise GGUFError("unsupported GGUF model: mixture-of-experts llama (expert tensors) cannot be converted")
    if "rope_freqs.weight" in names:
        raise GGUFError("unsupported GGUF model: per-frequency RoPE factors (rope_freqs.weight, "
                        "Llama 3.1-style RoPE scaling) cannot be converted")
    scaling = header.metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"unsupported GGUF RoPE scaling {scaling!r} (supported: none, linear)")
    bad = [t for t in header.tensors if t.type not in SUPPORTED_TYPES]
    if bad:
        kinds = ", ".join(sorted({t.type for t in bad}))
        raise GGUFError(
            f"unsupported GGUF tensor type {kinds} ({bad[0].name}"
            + (f" and {len(bad) - 1} more tensors" if len(bad) > 1 else "") + "): MLX loads "
            + ", ".join(QUANTIZED_TYPES + FLOAT_TYPES + DEQUANTIZED_TYPES)
            + "; re-quantize the model to Q4_0, Q4_1 or Q8_0 (llama.cpp's llama-quantize)")


def mlx_name(name: str) -> str:
    """The mlx_lm llama parameter name of a GGUF tensor name (``blk.3.attn_q.scales`` ->
    ``model.layers.3.self_attn.q_proj.scales``).

    Raises:
        GGUFError: a tensor the llama model has no place for.
    """
    stem, _, suffix = name.rpartition(".")
    if suffix in _SUFFIXES:
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
        if stem in _TOP_NAMES:
            return f"{_TOP_NAMES[stem]}.{suffix}"
    raise GGUFError(f"unsupported GGUF tensor {name!r}: the llama model has no such weight")


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def llama_config(meta: dict, weights: dict) -> dict:
    """The mlx_lm ``config.json`` of a llama GGUF file.

    Args:
        meta: GGUF metadata from ``mx.load(path, return_metadata=True)``.
        weights: the tensors under their mlx_lm names (see :func:`mlx_name`).

    Raises:
        GGUFError: a required ``llama.*`` key is missing, or RoPE covers part of a head only.
    """
    def need(key: str):
        value = _scalar(meta, f"llama.{key}")
        if value is None:
            raise GGUFError(f"the GGUF file lacks the metadata key llama.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_scalar(meta, "llama.attention.key_length", hidden // heads))
    if int(_scalar(meta, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError("unsupported GGUF model: RoPE over part of each head (llama.rope.dimension_count)")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)), "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length", 4096)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
    }
    if _scalar(meta, "llama.rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(_scalar(meta, "llama.rope.scaling.factor", 1.0))}
    eos = [_scalar(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    if eos:
        config["eos_token_id"] = eos
    if _scalar(meta, "tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
    bits = Counter((weights[k[:-6] + "weight"].shape[-1] * 32) // (v.shape[-1] * 32)
                   for k, v in weights.items() if k.endswith(".scales"))
    if bits:  # per-module bits differing from the default are inferred by mlx_lm from the shapes
        config["quantization"] = {"group_size": 32, "bits": bits.most_common(1)[0][0]}
    return config


def _default_progress(done: int, total: int) -> None:
    log.info("converting: %d/%d MLX arrays written", done, total)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                 progress: Optional[Callable[[int, int], None]] = None, source: Optional[dict] = None) -> Path:
    """Convert the llama GGUF file ``gguf_path`` into the MLX model directory ``out_dir``.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: the directory to create; it must not exist or be empty unless ``overwrite``.
        overwrite: replace an existing ``out_dir`` (only once the new one is complete).
        progress: called as ``progress(arrays_written, arrays_total)`` after each
            safetensors shard (at most ``SHARD_BYTES``) is written; by default a log line.
        source: extra entries for ``gguf_source.json`` (e.g. the file's sha256).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        GGUFError: unsupported architecture, tensor, tensor type or tokenizer; a file MLX
            cannot read; ``out_dir`` not empty without ``overwrite``; converted weights
            that mlx_lm's llama model does not accept.
        OSError: reading or writing files failed.
    """
    import mlx.core as mx

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GGUFError(f"{out_dir} already exists and is not empty (choose another directory or overwrite it)")
    header = read_header(gguf_path)
    check_supported(header)
    try:
        raw, meta = mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"MLX cannot read {gguf_path}: {e}") from None
    slow = Counter(t.type for t in header.tensors if t.type in DEQUANTIZED_TYPES)
    if slow:
        log.warning("GGUF tensors of types %s are stored as float16 (MLX dequantizes them)", dict(slow))
    weights = {mlx_name(k): v for k, v in raw.items()}
    config = llama_config(meta, weights)
    log.info("read %d GGUF tensors (%s) from %s", len(header.tensors),
             ", ".join(f"{n} {k}" for k, n in Counter(t.type for t in header.tensors).most_common()), gguf_path.name)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        report = progress or _default_progress
        shards: list[dict] = [{}]
        size = 0
        for name in sorted(weights):
            v = weights[name]  # dtypes as stored: llama.cpp's F32 norms keep activations in float32
            if size and size + v.nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = v
            size += v.nbytes
        done = 0
        for n, shard in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(tmp / file), shard, metadata={"format": "mlx"})
            done += len(shard)
            report(done, len(weights))
        del shards, weights, raw
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(meta, tmp, config["max_position_embeddings"])
        types = Counter(t.type for t in header.tensors)
        (tmp / "gguf_source.json").write_text(json.dumps(
            {"file": gguf_path.name, "converter_version": CONVERTER_VERSION, "tensor_types": dict(types),
             "name": _scalar(meta, "general.name"), **(source or {})}, indent=2))
        _check_loads(tmp)
        _move_into_place(tmp, out_dir, overwrite)
    except GGUFTokenizerError as e:
        raise GGUFError(str(e)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s into %s", gguf_path.name, out_dir)
    return out_dir


def _check_loads(path: Path) -> None:
    """Load the weights as mlx_lm will (lazily, names and shapes checked)."""
    from mlx_lm.utils import load_model

    try:
        load_model(path, lazy=True)
    except (ValueError, KeyError, TypeError) as e:
        msg = " ".join(str(e).split())
        raise GGUFError(f"the converted weights do not fit mlx_lm's llama model: {msg[:300]}") from None


def _move_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    old = None
    if out_dir.exists():
        if overwrite and (out_dir.is_file() or any(out_dir.iterdir())):
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out_dir, old)
        else:
            out_dir.rmdir()  # empty
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
