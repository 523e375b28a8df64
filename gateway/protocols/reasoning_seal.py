"""Sealed reasoning: the ``encrypted_content`` of Responses ``reasoning`` items.

A client that keeps no state on the server (``store: false``, Codex CLI) asks for
``include: ["reasoning.encrypted_content"]`` and sends each reasoning item back with its
next request. The gateway seals the reasoning text into that field with authenticated
encryption (AES-256-GCM from the ``cryptography`` package, a random 96-bit nonce per
item, the tenant's name as associated data), so the item comes back exactly as it was
generated: the same prompt is rendered again and served from the prefix cache, no other
tenant can open it, and a changed byte fails the tag.

The key is 32 random bytes: ``$MLX_GATEWAY_REASONING_KEY`` (base64, for replicas that
must open each other's items), else the file ``reasoning.key`` in the data directory,
made at first use (mode 0600), so items sealed before a restart still open after it. A
gateway that never seals or opens an item never reads or writes the key
(:class:`LazySeal`), so a read-only data directory does not keep it from starting.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.data_dir import data_root
from gateway.http.errors import APIError

log = logging.getLogger("mlx_gateway.reasoning")

KEY_ENV = "MLX_GATEWAY_REASONING_KEY"
KEY_FILE = "reasoning.key"
_VERSION = b"\x01"
_NONCE = 12


class ReasoningSeal:
    """Seals and opens reasoning text for one key (32 bytes)."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("the reasoning key must be 32 bytes")
        self._aead = AESGCM(key)

    def seal(self, reasoning: str, tenant: str) -> str:
        """``reasoning`` as an opaque string (base64) that only this key opens, for ``tenant``."""
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, json.dumps({"r": reasoning}).encode(), tenant.encode())
        return base64.b64encode(_VERSION + nonce + sealed).decode()

    def open(self, token: str, tenant: str) -> Optional[str]:
        """The reasoning sealed in ``token`` for ``tenant``; None when it is not one of this
        key's (another server's, another tenant's, changed or cut)."""
        try:
            raw = base64.b64decode(token, validate=True)
            if raw[:1] != _VERSION:
                return None
            plain = self._aead.decrypt(raw[1:1 + _NONCE], raw[1 + _NONCE:], tenant.encode())
            value = json.loads(plain).get("r")
        except (binascii.Error, ValueError, InvalidTag, AttributeError):
            return None
        return value if isinstance(value, str) else None


def load_seal(directory: Optional[Path] = None) -> ReasoningSeal:
    """The seal of ``$MLX_GATEWAY_REASONING_KEY``, else of ``reasoning.key`` in
    ``directory`` (the data directory by default), written there first if missing.

    Raises:
        ValueError: the environment variable is not 32 bytes in base64.
        OSError: the key file cannot be read or written.
    """
    env = os.environ.get(KEY_ENV)
    if env:
        try:
            return ReasoningSeal(base64.b64decode(env, validate=True))
        except binascii.Error as e:
            raise ValueError(f"{KEY_ENV} is not base64: {e}") from None
    path = (directory or data_root()) / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        try:
            os.link(tmp, path)  # never replaces: of two starts at once, the first key is both's
            log.info("made a reasoning key at %s", path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return ReasoningSeal(path.read_bytes())


class LazySeal:
    """A :class:`ReasoningSeal` whose key is loaded (:func:`load_seal`) at its first use,
    once, whichever thread asks first.

    Raises (from :meth:`seal` and :meth:`open`):
        APIError: 503 when the key cannot be loaded (see :func:`load_seal`), with why.
    """

    def __init__(self, directory: Optional[Path] = None):
        self._directory = directory
        self._seal: Optional[ReasoningSeal] = None
        self._lock = threading.Lock()

    def _loaded(self) -> ReasoningSeal:
        with self._lock:
            if self._seal is None:
                try:
                    self._seal = load_seal(self._directory)
                except (OSError, ValueError) as e:
                    log.error("the reasoning key cannot be loaded: %s", e)
                    raise APIError(503, f"the server cannot seal reasoning: its key cannot be loaded ({e})",
                                   code="reasoning_key_unavailable") from None
            return self._seal

    def seal(self, reasoning: str, tenant: str) -> str:
        """As :meth:`ReasoningSeal.seal`."""
        return self._loaded().seal(reasoning, tenant)

    def open(self, token: str, tenant: str) -> Optional[str]:
        """As :meth:`ReasoningSeal.open`."""
        return self._loaded().open(token, tenant)
