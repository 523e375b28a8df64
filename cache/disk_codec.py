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

The entry file format and the model identity are in ``disk_format.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .kinds import kind_of

CODEC_VERSION = "1"

# MLX dtypes numpy lacks -> the same-width unsigned type their bits are stored as.
_AS_BITS: dict[str, Any] = {"bfloat16": mx.uint16}
_MX_DTYPES: dict[str, Any] = {
    str(d).rsplit(".", 1)[-1]: d for d in (getattr(mx, n) for n in dir(mx)) if isinstance(d, mx.Dtype)
}

# -- encode -------------------------------------------------------------------
def _mlx_cache() -> Any:
    """``mlx_lm.models.cache``, imported on first use (mlx-lm takes ~1 s to import;
    the disk store only needs the file-format helpers below)."""
    from mlx_lm.models import cache

    return cache


def _as_mlx(layer: Any) -> Any:
    """``layer`` as the mlx-lm class its kind's ``disk`` column says it is written as (the
    disk format names only mlx-lm's classes): ``quantized``, mlx-lm's ``QuantizedKVCache``
    cut to its tokens (:func:`decode_snapshot` turns it back into a
    :class:`cache.quantized.QuantizedKVRow`); ``kv``, mlx-lm's ``KVCache`` (pages joined);
    ``state``, itself."""
    disk = kind_of(layer).disk
    if disk == "quantized":
        from cache.quantized import QuantizedKVRow

        row = QuantizedKVRow.of(layer)
        plain = _mlx_cache().QuantizedKVCache(row.group_size, row.bits)
        plain.keys, plain.values, plain.offset = row.state[:3]  # cut to its tokens
        return plain
    if disk == "kv":
        plain = _mlx_cache().KVCache()
        plain.state = layer.state  # keys and values cut to its tokens
        return plain
    return layer


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
        layer = _as_mlx(layer)
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
    metadata = {"codec": CODEC_VERSION, "layers": json.dumps(layers, separators=(",", ":")),
                "dtypes": json.dumps(dtypes, separators=(",", ":"), sort_keys=True)}
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
        if kind_of(obj).disk == "quantized":
            from cache.quantized import QuantizedKVRow

            obj = QuantizedKVRow.of(obj)
        out.append(obj)
    unused = arrays.keys() - used
    if unused:
        raise ValueError(f"arrays not referenced by any layer: {sorted(unused)[:5]}")
    return out
