"""Images in a vision-language model's prompt, as request code sees them (no MLX here): the
token ids standing for an image, the preprocessed images of a prompt, the table of images
in flight, and a served model's vision side.

**Images in the token stream.** The processor expands each image into ``n`` placeholder
tokens (Gemma 3: 256 ``<image_soft_token>``). In the prompt the engine sees, those ``n``
positions hold *image token ids* derived from a SHA-256 of the image's preprocessed
pixels (:func:`image_ids`): integers of at least :data:`IMAGE_ID_BASE` (2**62), far above
any vocabulary. The prefix cache keys on token ids, so two different images never share
KV (their ids differ), and the same image, sent again behind the same text, finds its
prefill in the cache (its ids are the same, in this process and after a restart:
the disk tier keys on them too).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

IMAGE_ID_BASE = 1 << 62  # image token ids are IMAGE_ID_BASE + (seed + i) mod IMAGE_ID_SPAN
IMAGE_ID_SPAN = 1 << 61


def image_ids(digest: bytes, n: int) -> list[int]:
    """The ``n`` token ids standing for an image whose preprocessed pixels hash to
    ``digest`` (SHA-256): consecutive integers from a 61-bit seed taken from the digest,
    above :data:`IMAGE_ID_BASE`. Two images share ids only if their digests share those
    61 bits."""
    seed = int.from_bytes(digest[:8], "little") % IMAGE_ID_SPAN
    return [IMAGE_ID_BASE + (seed + i) % IMAGE_ID_SPAN for i in range(n)]


def pixel_digest(pixels: np.ndarray, grid: tuple[int, ...] = ()) -> bytes:
    """SHA-256 of an image's preprocessed pixels: their float32 bytes and shape, and its
    patch grid if it has one (:class:`ImageInput`)."""
    a = np.ascontiguousarray(pixels, dtype=np.float32)
    h = hashlib.sha256(json.dumps(list(a.shape) + ([list(grid)] if grid else [])).encode())
    h.update(a.tobytes())
    return h.digest()


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image of a prompt.

    Attributes:
        pixels: what the processor made of it (e.g. ``[3, H, W]`` float32).
        digest: :func:`pixel_digest` of ``pixels``.
        ids: the token ids of its positions in the prompt (:func:`image_ids`).
        size: its decoded size ``(width, height)`` in pixels, before preprocessing.
        grid: its patch grid ``(t, h, w)`` for processors that give one (Qwen's
            ``image_grid_thw``; ``pixels`` is then ``[t*h*w, patch values]``), else ``()``.
    """

    pixels: np.ndarray
    digest: bytes
    ids: tuple[int, ...]
    size: tuple[int, int] = (0, 0)
    grid: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.ids)


class ImageTable:
    """The images of the requests in flight, by image token id (thread-safe).

    The gateway adds a request's images before it submits it and releases them when the
    request's last event has been sent (:meth:`releasing`), so an image is here for
    every forward that can reach it. Only numpy arrays are held here; the MLX features
    computed from them live on the engine thread (:class:`VisionLanguageModel`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_first: dict[int, list] = {}  # first id -> [image, references]
        self._where: dict[int, tuple[int, int]] = {}  # id -> (first id, index in the image)

    def add(self, images: list[ImageInput]) -> None:
        with self._lock:
            for im in images:
                entry = self._by_first.get(im.ids[0])
                if entry is None:
                    self._by_first[im.ids[0]] = [im, 1]
                    for i, t in enumerate(im.ids):
                        self._where[t] = (im.ids[0], i)
                else:
                    entry[1] += 1

    def release(self, images: list[ImageInput]) -> None:
        with self._lock:
            for im in images:
                entry = self._by_first.get(im.ids[0])
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._by_first[im.ids[0]]
                    for t in im.ids:
                        self._where.pop(t, None)

    def releasing(self, sink, images: list[ImageInput]):
        """``sink`` (an engine request's) that releases ``images`` once it has passed on
        the request's last event (a done or error event)."""
        from scheduler.request import DoneEvent, ErrorEvent

        released = []

        def wrapped(events) -> None:
            try:
                sink(events)
            finally:
                if not released and any(isinstance(e, (DoneEvent, ErrorEvent)) for e in events):
                    released.append(True)
                    self.release(images)

        return wrapped

    def locate(self, token: int) -> Optional[tuple[ImageInput, int]]:
        """The image holding position ``token``, and the position's index in it."""
        with self._lock:
            where = self._where.get(token)
            if where is None:
                return None
            return self._by_first[where[0]][0], where[1]

    def live(self, first: int) -> bool:
        with self._lock:
            return first in self._by_first

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_first)



@dataclass
class VisionModel:
    """The vision side of a served model, as request code sees it (no MLX here).

    Attributes:
        processor: mlx-vlm's processor (image preprocessing, placeholder expansion).
        image_token_id: the placeholder token of an image position.
        table: the images in flight (shared with the engine's model).
        model_type: the checkpoint's ``model_type``.
    """

    processor: Any
    image_token_id: int
    table: ImageTable
    model_type: str
    lock: threading.Lock = field(default_factory=threading.Lock)
