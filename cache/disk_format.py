"""Entry file format and model identity of the prompt cache's disk tier (``disk.py``).

Any thread: numpy and bytes only. An entry file is a safetensors file holding the
arrays of ``disk_codec.encode_snapshot``; its metadata holds the codec's keys and
these reserved keys:

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

import numpy as np
import safetensors.numpy as st_numpy
from safetensors import safe_open

FORMAT_VERSION = "1"  # of the entry files (disk.py)
RESERVED_KEYS = frozenset({"disk_format", "model", "group", "tokens", "trimmable", "data_bytes", "checksum"})
# Bumped when what model_identity hashes changes (old disk entries are then not seen).
IDENTITY_VERSION = "mlx-gateway-model-identity/1"

# model_identity sampling: CHUNKS chunks of CHUNK_BYTES bytes per weight file.
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK_BYTES = 64 * 1024
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "chat_template.jinja")
_I64 = 2**63  # token ids are hashed as int64
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # bytes; safetensors' own limit


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
                trimmable="1" if trimmable else "0", data_bytes=str(sum(int(a.nbytes) for a in arrays.values())))
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


def model_identity(model_dir: Path, chat_template: str | None = None, loaded_as: str | None = None,
                   served_as: str | None = None) -> str:
    """A hex digest (64 chars, blake2b-256) that names a model for the disk tier.

    Hashes :data:`IDENTITY_VERSION`; ``config.json``; the tokenizer files present
    (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``tokenizer.model``, ``chat_template.jinja``); ``chat_template``; the names and
    sizes (bytes) of the ``*.safetensors`` / ``*.gguf`` files; each safetensors
    header (tensor names, dtypes, shapes, offsets); :data:`SAMPLE_CHUNKS`
    chunks of :data:`SAMPLE_CHUNK_BYTES` bytes spread evenly through each weight
    file (the whole file when smaller); and ``loaded_as`` when given: how the weights
    were changed after loading (``"float32"``: :mod:`gateway.cpu.weights`), which
    changes the snapshots' dtype; and ``served_as`` when given: the name a gateway
    serves the model under, so that the same files served under two names get two
    directories (one disk tier holds a directory at a time).

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
    if loaded_as is not None:
        part("loaded_as", loaded_as.encode())
    if served_as is not None:
        part("served_as", served_as.encode())
    return h.hexdigest()
