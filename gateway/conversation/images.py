"""The images of a request: fetched (when allowed), decoded and checked against the limits.

Every protocol hands its images over as :class:`~gateway.conversation.form.ImageRef` s
in the turns. An image is a ``data:`` URL (base64; what browser extensions send), base64
data with its media type (Anthropic), or an http(s) URL, which is fetched only when the
server allows it (``--allow-image-urls``), with a byte bound and a time bound. Base64
and image decoding (Pillow) run in a worker thread (:func:`decode_images`), never on the
event loop nor on the engine thread; so does the model's preprocessing
(:mod:`gateway.conversation.vision_prompt`).

Limits (:class:`ImageLimits`, the ``serve`` flags ``--max-image-bytes``,
``--max-image-pixels``, ``--max-images``): a request with more images than allowed is a
400 ``too_many_images``; an image over the byte bound a 413 ``image_too_large``; over the
pixel bound (width x height, read from its header before it is decoded) a 400
``image_too_large``; one that cannot be decoded a 400 ``invalid_image``. All are checked
before anything reaches the engine. :func:`admit_images` checks and fetches a request's
images for its model (a text-only model answers 400 "does not accept images"), counting
refusals in ``mlx_gateway_images_refused``; their tokens are charged with the prompt's
(:class:`gateway.conversation.books.Books`).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Optional

from gateway.conversation.form import Conversation, ImageRef
from gateway.front import Call
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle

_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?)(?P<b64>;base64)?,", re.I)


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on a request's images (see the module docstring).

    Attributes:
        max_bytes: bytes of one image (encoded, after base64 decoding).
        max_pixels: width x height of one image.
        max_images: images in one request.
        allow_urls: fetch http(s) image URLs.
        fetch_timeout: seconds a fetch may take in all.
    """

    max_bytes: int = 10 << 20
    max_pixels: int = 7680 * 4320
    max_images: int = 16
    allow_urls: bool = False
    fetch_timeout: float = 10.0


def images_of(conv: Conversation) -> list[ImageRef]:
    """The conversation's images, in order."""
    return [im for t in conv.turns for im in t.images]


class RefusedImage(APIError):
    """An image the limits or the decoder refused; ``reason`` labels the metric."""

    def __init__(self, status: int, message: str, param: str, code: str, reason: str):
        super().__init__(status, message, param=param, code=code)
        self.reason = reason


def check_count(refs: list[ImageRef], limits: ImageLimits) -> None:
    """Raises:
        RefusedImage: 400 ``too_many_images``."""
    if len(refs) > limits.max_images:
        raise RefusedImage(400, f"the request has {len(refs)} images; at most {limits.max_images} are allowed",
                           refs[limits.max_images].param, "too_many_images", "too_many_images")


def _too_large(ref: ImageRef, size: int, limits: ImageLimits) -> RefusedImage:
    return RefusedImage(413, f"the image is {size} bytes; at most {limits.max_bytes} are allowed", ref.param,
                        "image_too_large", "too_large")


async def fetch_images(refs: list[ImageRef], limits: ImageLimits) -> dict[int, bytes]:
    """The bytes of the http(s) images of ``refs`` (by index in ``refs``), fetched with
    the limits' byte and time bounds; ``data:`` URLs and base64 data are left to
    :func:`decode_images`.

    Raises:
        RefusedImage: 400 ``image_url_not_allowed`` when URLs are off, 400
            ``image_fetch_failed`` for a fetch that failed or timed out, 413 over the
            byte bound, 400 ``invalid_image`` for another URL scheme.
    """
    import anyio
    import httpx

    out: dict[int, bytes] = {}
    for i, ref in enumerate(refs):
        if ref.data is not None or ref.url is None or ref.url[:5].lower() == "data:":
            continue
        scheme = ref.url.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise RefusedImage(400, "an image must be a data: URL (base64) or an http(s) URL", ref.param,
                               "invalid_image", "malformed")
        if not limits.allow_urls:
            raise RefusedImage(400, "this server does not fetch image URLs: send the image inline as a data: URL "
                               "(base64)", ref.param, "image_url_not_allowed", "fetch")
        try:
            with anyio.fail_after(limits.fetch_timeout):
                async with httpx.AsyncClient(follow_redirects=True, max_redirects=3,
                                             timeout=limits.fetch_timeout) as client:
                    async with client.stream("GET", ref.url) as r:
                        if r.status_code != 200:
                            raise RefusedImage(400, f"fetching the image gave HTTP {r.status_code}", ref.param,
                                               "image_fetch_failed", "fetch")
                        declared = r.headers.get("content-length")
                        if declared and declared.isdigit() and int(declared) > limits.max_bytes:
                            raise _too_large(ref, int(declared), limits)
                        chunks, n = [], 0
                        async for chunk in r.aiter_bytes():
                            n += len(chunk)
                            if n > limits.max_bytes:
                                raise _too_large(ref, n, limits)
                            chunks.append(chunk)
                        out[i] = b"".join(chunks)
        except RefusedImage:
            raise
        except TimeoutError:
            raise RefusedImage(400, f"fetching the image took over {limits.fetch_timeout:g} s", ref.param,
                               "image_fetch_failed", "fetch") from None
        except httpx.HTTPError as e:
            raise RefusedImage(400, f"fetching the image failed: {e}", ref.param, "image_fetch_failed",
                               "fetch") from None
    return out


def _payload(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The encoded image of a ``data:`` URL or base64 ``data``."""
    if ref.data is not None:
        text = ref.data
    else:
        m = _DATA_URL.match(ref.url or "")
        if m is None or not m.group("b64"):
            raise RefusedImage(400, "an image must be a base64 data: URL (data:image/png;base64,...) or base64 data "
                               "with its media type", ref.param, "invalid_image", "malformed")
        text = (ref.url or "")[m.end():]
    if len(text) > limits.max_bytes * 4 // 3 + 8:  # refused before it is decoded
        raise _too_large(ref, len(text) * 3 // 4, limits)
    try:
        raw = base64.b64decode(text.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise RefusedImage(400, "the image's base64 data is not valid", ref.param, "invalid_image",
                           "malformed") from None
    if len(raw) > limits.max_bytes:
        raise _too_large(ref, len(raw), limits)
    return raw


def decode_images(refs: list[ImageRef], fetched: dict[int, bytes], limits: ImageLimits) -> list:
    """Each image of ``refs`` as an RGB Pillow image (worker thread).

    Raises:
        RefusedImage: 413 over the byte bound; 400 over the pixel bound, for data that
            is not an image Pillow reads, or a truncated one.
    """
    from PIL import Image, UnidentifiedImageError

    out = []
    for i, ref in enumerate(refs):
        raw = fetched[i] if i in fetched else _payload(ref, limits)
        if len(raw) > limits.max_bytes:
            raise _too_large(ref, len(raw), limits)
        try:
            img = Image.open(io.BytesIO(raw))
            w, h = img.size
            if w * h > limits.max_pixels:
                raise RefusedImage(400, f"the image is {w}x{h} pixels; at most {limits.max_pixels} pixels are "
                                   "allowed", ref.param, "image_too_large", "too_many_pixels")
            if w < 1 or h < 1:
                raise ValueError("empty image")
            img.load()
            out.append(img.convert("RGB"))
        except RefusedImage:
            raise
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise RefusedImage(400, f"the image could not be decoded: {e}", ref.param, "invalid_image",
                               "malformed") from None
    return out


def describe(refs: list[ImageRef]) -> Optional[str]:
    """Where the first image is, for the 400 of a model that takes none."""
    return refs[0].param if refs else None


async def admit_images(call: Call, model: ModelHandle, conv: Conversation) -> Optional[tuple]:
    """Check and fetch the images of ``conv`` for ``model`` (the ``serve`` flags' limits):
    :func:`~gateway.conversation.prepare.prepare_chat`'s ``images`` (None when it has none).

    Raises:
        APIError: 400 when the model reads no images; what :func:`check_count` and
            :func:`fetch_images` raise.
    """
    refs = images_of(conv)
    if not refs:
        return None
    refused = call.front.metrics.images_refused
    if model.kind != "vision":
        refused.labels(call.tenant.name, "not_vision").inc()
        raise APIError(400, f"the model '{model.name}' does not accept images: send text only", param=refs[0].param)
    c = call.front.config
    limits = ImageLimits(c.max_image_bytes, c.max_image_pixels, c.max_images, c.allow_image_urls,
                         c.image_fetch_timeout)
    try:
        check_count(refs, limits)
        fetched = await fetch_images(refs, limits)
    except RefusedImage as e:
        refused.labels(call.tenant.name, e.reason).inc()
        raise
    return refs, fetched, limits
