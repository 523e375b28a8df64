"""Snapshot <-> numpy codec, entry file format and model identity for ``disk.py``.

Engine-thread functions: :func:`encode_snapshot` and :func:`decode_snapshot` touch
``mlx.core`` arrays, so they must run on the thread that owns MLX (MLX on Metal is
not thread-safe). Their numpy/bytes results are what the disk tier's threads see.

Format (source: mlx-lm ``save_prompt_cache`` / ``load_prompt_cache`` in
``mlx_lm/models/cache.py``, which flatten ``[c.state for c in cache]`` with
``mlx.utils.tree_flatten`` and rebuild each layer with ``cls.from_state``):

- one array per ``mx.array`` leaf of a layer's ``state`` (and ``meta_state`` where
  the installed mlx-lm has one), named by its dotted path like ``tree_flatten``
  does (``"3.0"`` is layer 3's keys, ``"5.0.0.1"`` a value inside a ``CacheList``);
- metadata (all strings):

  ``codec``   :data:`CODEC_VERSION`.
  ``layers``  JSON list, per layer ``{"class", "state", "meta"}``: the class name
              in ``mlx_lm.models.cache`` and the *skeleton* of ``state`` /
              ``meta_state``. A skeleton is JSON where an array leaf is
              ``{"a": name}``, a tuple ``{"t": [...]}``, a dict ``{"d": {...}}``, a
              list a list, and ints/floats/bools/strings/None stand for
              themselves. Unlike ``tree_flatten`` it keeps empty containers,
              tuples and scalar types, so a round trip is exact.
  ``dtypes``  JSON object, array name -> original MLX dtype name (``"bfloat16"``).

numpy has no bfloat16: such arrays are stored as their bits (``arr.view(mx.uint16)``)
and viewed back on decode.

File format helpers for ``disk.py`` (any thread: numpy and bytes only). Besides the
codec's keys an entry file's metadata holds these reserved keys:

``disk_format``  :data:`FORMAT_VERSION`.
``model``        the full model identity.
``group``        the cache group (tenant namespace).
``tokens``       the key, compact JSON list of token ids.
``trimmable``    ``"1"`` if every layer can be trimmed to a shorter prefix, else ``"0"``.
``data_bytes``   bytes of tensor data (file size = 8 + header length + this).
``checksum``     hex SHA-256 (:func:`payload_checksum`) of the sorted-key JSON of all
                 other metadata, then of each array in name order (name, dtype,
                 shape, byte length, bytes): header and data are both covered.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy as st_numpy
from safetensors import safe_open

CODEC_VERSION = "1"
FORMAT_VERSION = "1"  # of the entry files (disk.py)
RESERVED_KEYS = frozenset({"disk_format", "model", "group", "tokens", "trimmable", "data_bytes", "checksum"})
# Bumped when what model_identity hashes changes (old disk entries are then not seen).
IDENTITY_VERSION = "mlx-gateway-model-identity/1"

# MLX dtypes numpy lacks -> the same-width unsigned type their bits are stored as.
_AS_BITS: dict[str, Any] = {"bfloat16": mx.uint16}
_MX_DTYPES: dict[str, Any] = {
    str(d).rsplit(".", 1)[-1]: d for d in (getattr(mx, n) for n in dir(mx)) if isinstance(d, mx.Dtype)
}

# model_identity sampling: CHUNKS chunks of CHUNK_BYTES bytes per weight file.
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK_BYTES = 64 * 1024
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "chat_template.jinja")
_I64 = 2**63  # token ids are hashed as int64
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # bytes; safetensors' own limit


# -- encode -------------------------------------------------------------------
def _mlx_cache() -> Any:
    """``mlx_lm.models.cache``, imported on first use (mlx-lm takes ~1 s to import;
    the disk store only needs the file-format helpers below)."""
    from mlx_lm.models import cache

    return cache


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _skeleton(obj: Any, path: str, leaves: dict[str, mx.array]) -> Any:
    """JSON skeleton of ``obj``; its ``mx.array`` leaves go into ``leaves`` by dotted path."""
    if isinstance(obj, mx.array):
        leaves[path] = obj
        return {"a": path}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj)
    if isinstance(obj, (list, tuple)):
        items = [_skeleton(v, f"{path}.{i}", leaves) for i, v in enumerate(obj)]
        return {"t": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"d": {k: _skeleton(v, f"{path}.{k}", leaves) for k, v in obj.items()}}
    raise ValueError(f"cache state is not serializable: {type(obj).__name__} at {path!r}")


def encode_snapshot(cache: Sequence[Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Flatten a snapshot (list of mlx-lm layer caches) into numpy arrays + string metadata.

    Engine thread only. The arrays are copies that own their memory: the caller may
    drop or keep writing the MLX arrays afterwards.

    Returns:
        ``(arrays, metadata)``: arrays by dotted path, metadata keys ``codec``,
        ``layers``, ``dtypes`` (see the module docstring).

    Raises:
        ValueError: a state holds something other than arrays, containers and
            JSON scalars, or a class is not defined in ``mlx_lm.models.cache``.
    """
    leaves: dict[str, mx.array] = {}
    layers = []
    for i, layer in enumerate(cache):
        name = type(layer).__name__
        if getattr(_mlx_cache(), name, None) is not type(layer):
            raise ValueError(f"layer {i}: {name} is not an mlx_lm.models.cache class")
        meta = None
        if hasattr(type(layer), "meta_state"):
            meta = _skeleton(layer.meta_state, f"{i}.meta", leaves)
        layers.append({"class": name, "state": _skeleton(layer.state, str(i), leaves), "meta": meta})
    mx.eval(list(leaves.values()))
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for path, arr in leaves.items():
        dname = _dtype_name(arr.dtype)
        dtypes[path] = dname
        bits = _AS_BITS.get(dname)
        arrays[path] = np.array(arr.view(bits) if bits is not None else arr, copy=True)
    metadata = {
        "codec": CODEC_VERSION,
        "layers": json.dumps(layers, separators=(",", ":")),
        "dtypes": json.dumps(dtypes, separators=(",", ":"), sort_keys=True),
    }
    return arrays, metadata


# -- decode -------------------------------------------------------------------
def _to_mx(np_arr: Any, dname: str, path: str) -> mx.array:
    if not isinstance(np_arr, np.ndarray):
        raise ValueError(f"array {path!r} is not a numpy array")
    bits = _AS_BITS.get(dname)
    want = _MX_DTYPES.get(dname)
    if want is None:
        raise ValueError(f"array {path!r}: unknown dtype {dname!r}")
    stored = _dtype_name(bits) if bits is not None else dname
    if np_arr.dtype.name != stored:
        raise ValueError(f"array {path!r}: stored as {np_arr.dtype.name}, expected {stored}")
    out = mx.array(np_arr)
    return out.view(want) if bits is not None else out


def _build(sk: Any, arrays: dict[str, np.ndarray], dtypes: dict[str, str], used: set[str]) -> Any:
    if sk is None or isinstance(sk, (bool, int, float, str)):
        return sk
    if isinstance(sk, list):
        return [_build(v, arrays, dtypes, used) for v in sk]
    if isinstance(sk, dict) and len(sk) == 1:
        (tag, val), = sk.items()
        if tag == "a" and isinstance(val, str):
            if val not in arrays or val not in dtypes:
                raise ValueError(f"missing array {val!r}")
            used.add(val)
            return _to_mx(arrays[val], dtypes[val], val)
        if tag == "t" and isinstance(val, list):
            return tuple(_build(v, arrays, dtypes, used) for v in val)
        if tag == "d" and isinstance(val, dict):
            return {k: _build(v, arrays, dtypes, used) for k, v in val.items()}
    raise ValueError(f"malformed state skeleton: {str(sk)[:80]}")


def _cache_class(name: Any) -> type:
    mod = _mlx_cache()
    cls = getattr(mod, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, mod._BaseCache)):
        raise ValueError(f"unknown cache class {name!r}")
    return cls


def _check_members(name: str, state: Any) -> None:
    """``CacheList.state`` names its members' classes (looked up by mlx-lm): check them."""
    if name != "CacheList" or not isinstance(state, list):
        return
    for item in state:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            _cache_class(item[1])
            _check_members(item[1], item[0])


def decode_snapshot(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> list[Any]:
    """Rebuild the layer caches written by :func:`encode_snapshot`. Engine thread only.

    Extra metadata keys are ignored; every array must be used.

    Raises:
        ValueError: wrong codec version, malformed JSON or skeleton, unknown cache
            class, missing or unused array, dtype not matching the metadata, or a
            state the class refuses.
    """
    if metadata.get("codec") != CODEC_VERSION:
        raise ValueError(f"unsupported snapshot codec {metadata.get('codec')!r}")
    try:
        layers = json.loads(metadata["layers"])
        dtypes = json.loads(metadata["dtypes"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed snapshot metadata: {e}") from None
    if not isinstance(layers, list) or not isinstance(dtypes, dict):
        raise ValueError("malformed snapshot metadata")
    used: set[str] = set()
    out = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or not {"class", "state", "meta"} <= layer.keys():
            raise ValueError(f"layer {i}: malformed entry")
        cls = _cache_class(layer["class"])
        state = _build(layer["state"], arrays, dtypes, used)
        _check_members(layer["class"], state)
        meta = None if layer["meta"] is None else _build(layer["meta"], arrays, dtypes, used)
        try:
            obj = cls.from_state(state) if meta is None else cls.from_state(state, meta)
        except Exception as e:  # a class rejecting its state is a malformed file
            raise ValueError(f"layer {i}: {layer['class']}.from_state failed: {e}") from None
        out.append(obj)
    unused = arrays.keys() - used
    if unused:
        raise ValueError(f"arrays not referenced by any layer: {sorted(unused)[:5]}")
    return out


# -- file format ----------------------------------------------------------------
def entry_name(group: str, tokens: Sequence[int]) -> str:
    """File stem of the entry keyed ``(group, tokens)``: 40 hex chars of SHA-256."""
    h = hashlib.sha256()
    g = group.encode()
    h.update(struct.pack("<Q", len(g)) + g)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()[:40]


def payload_checksum(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """Hex SHA-256 of ``metadata`` (minus ``checksum``) and ``arrays``; see the module doc."""
    h = hashlib.sha256()
    meta = {k: v for k, v in metadata.items() if k != "checksum"}
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        desc = json.dumps([name, a.dtype.str, list(a.shape), a.nbytes]).encode()
        h.update(struct.pack("<Q", len(desc)) + desc)
        h.update(a.reshape(-1).view(np.uint8) if a.nbytes else b"")
    return h.hexdigest()


def check_file_metadata(meta: dict[str, str], model: str, stem: str) -> list[int]:
    """Validate the reserved keys of an entry file named ``stem`` for ``model``.

    Returns:
        The token key.

    Raises:
        ValueError: a key is missing or malformed, or does not match ``model`` / ``stem``.
    """
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a str -> str map")
    missing = RESERVED_KEYS - meta.keys()
    if missing:
        raise ValueError(f"missing metadata {sorted(missing)}")
    if meta["disk_format"] != FORMAT_VERSION or meta["model"] != model:
        raise ValueError("other format version or model identity")
    try:
        tokens = json.loads(meta["tokens"])
        int(meta["data_bytes"])
    except ValueError:
        raise ValueError("malformed tokens or data_bytes") from None
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int and -_I64 <= t < _I64 for t in tokens):
        raise ValueError("malformed tokens")
    if meta["trimmable"] not in ("0", "1") or entry_name(meta["group"], tokens) != stem:
        raise ValueError("trimmable flag or file name does not match the key")
    return tokens


def build_file(arrays: dict[str, np.ndarray], metadata: dict[str, str], *, model: str,
               group: str, tokens: Sequence[int], trimmable: bool) -> bytes:
    """The bytes of an entry file: ``metadata`` plus the reserved keys, checksummed.

    Holds the whole file in memory (``safetensors.numpy.save``): about the arrays'
    size again while it lives.

    Raises:
        ValueError: a reserved key in ``metadata``, or an array safetensors refuses.
    """
    if RESERVED_KEYS & metadata.keys():
        raise ValueError(f"metadata keys {sorted(RESERVED_KEYS & metadata.keys())} are reserved")
    meta = dict(metadata)
    meta.update(disk_format=FORMAT_VERSION, model=model, group=group,
                tokens=json.dumps([int(t) for t in tokens], separators=(",", ":")),
                trimmable="1" if trimmable else "0",
                data_bytes=str(sum(int(a.nbytes) for a in arrays.values())))
    meta["checksum"] = payload_checksum(arrays, meta)
    try:
        return st_numpy.save(arrays, meta)
    except Exception as e:
        raise ValueError(f"cannot serialize: {e}") from None


def parse_file(data: bytes, model: str, stem: str) -> tuple[dict[str, np.ndarray], dict[str, str], list[int]]:
    """Parse and verify a whole entry file (``data``) named ``stem`` for ``model``.

    Returns:
        ``(arrays, metadata, tokens)``; ``metadata`` without the reserved keys.

    Raises:
        ValueError: unparseable, a reserved key wrong (:func:`check_file_metadata`),
            or a checksum mismatch.
    """
    try:
        n = struct.unpack("<Q", data[:8])[0]
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        arrays = st_numpy.load(data)
    except Exception as e:
        raise ValueError(f"unparseable file: {e}") from None
    tokens = check_file_metadata(meta, model, stem)
    if payload_checksum(arrays, meta) != meta["checksum"]:
        raise ValueError("checksum mismatch")
    return arrays, {k: v for k, v in meta.items() if k not in RESERVED_KEYS}, tokens


def read_file_header(path: Path, model: str) -> tuple[dict[str, str], list[int], int]:
    """Read only the header of the entry file ``path`` (named ``<stem>.safetensors``).

    Returns:
        ``(metadata, tokens, file size in bytes)``; the checksum is not verified.

    Raises:
        ValueError: unreadable header, a reserved key wrong, or a file size that
            does not match the header (a truncated file).
    """
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
        with safe_open(str(path), framework="numpy") as sf:
            meta = sf.metadata() or {}
    except Exception as e:  # SafetensorError, OSError, ...
        raise ValueError(f"unreadable header: {e}") from None
    tokens = check_file_metadata(meta, model, path.name.split(".", 1)[0])
    if len(head) != 8 or size != 8 + struct.unpack("<Q", head)[0] + int(meta["data_bytes"]):
        raise ValueError("file size does not match its header (truncated?)")
    return meta, tokens, size


# -- model identity -------------------------------------------------------------
def _sample(f: Any, size: int) -> list[bytes]:
    """:data:`SAMPLE_CHUNKS` chunks spread evenly over a ``size``-byte file (whole file if small)."""
    if size <= SAMPLE_CHUNKS * SAMPLE_CHUNK_BYTES:
        f.seek(0)
        return [f.read()]
    out = []
    span = size - SAMPLE_CHUNK_BYTES
    for i in range(SAMPLE_CHUNKS):
        f.seek(span * i // (SAMPLE_CHUNKS - 1))
        out.append(f.read(SAMPLE_CHUNK_BYTES))
    return out


def model_identity(model_dir: Path, chat_template: str | None = None) -> str:
    """A hex digest (64 chars, blake2b-256) that names a model for the disk tier.

    Hashes :data:`IDENTITY_VERSION`; ``config.json``; the tokenizer files present
    (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``tokenizer.model``, ``chat_template.jinja``); ``chat_template``; the names and
    sizes (bytes) of the ``*.safetensors`` / ``*.gguf`` files; each safetensors
    header (tensor names, dtypes, shapes, offsets); and :data:`SAMPLE_CHUNKS`
    chunks of :data:`SAMPLE_CHUNK_BYTES` bytes spread evenly through each weight
    file (the whole file when smaller).

    Trade-off: weights are *sampled*, not fully hashed, so an 8B model costs about
    1 MiB of reads per weight file instead of 16 GB. Two fine-tunes of one
    architecture differ in nearly every chunk and are told apart; an edit that
    touches only bytes between the samples (and keeps every size) is not seen.
    Keep a disk cache directory per deployment if that matters.

    Raises:
        FileNotFoundError: ``model_dir`` or its ``config.json`` is missing.
        ValueError: a safetensors file has a malformed header length.
        OSError: a file cannot be read.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    h = hashlib.blake2b(digest_size=32)

    def part(tag: str, data: bytes) -> None:
        for piece in (tag.encode(), data):
            h.update(struct.pack("<Q", len(piece)))
            h.update(piece)

    part("version", IDENTITY_VERSION.encode())
    config = model_dir / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    part("config.json", config.read_bytes())
    for name in _TOKENIZER_FILES:
        p = model_dir / name
        part(name if p.is_file() else f"absent:{name}", p.read_bytes() if p.is_file() else b"")
    part("chat_template", b"\x00none" if chat_template is None else chat_template.encode())
    weights = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.gguf"))
    for w in weights:
        size = w.stat().st_size
        part("weight", f"{w.name}\x00{size}".encode())
        with open(w, "rb") as f:
            if w.suffix == ".safetensors":
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 <= n <= min(size - 8, _MAX_SAFETENSORS_HEADER):
                    raise ValueError(f"{w}: malformed safetensors header length")
                part("header", f.read(n))
            for chunk in _sample(f, size):
                part("chunk", chunk)
    return h.hexdigest()
