"""Admitting a request's images: the model must read images, the counts and bytes must fit,
URLs are fetched, and the tenant's image tokens are charged (:data:`IMAGE_TOKEN_WINDOW`).

A text-only model asked about an image answers the 400 it always has ("does not accept
images"). The tenant's ``image_tokens_per_minute`` (tenants file) bounds the prompt
tokens that stand for images, beside its prompt-token limit: a request over it is a 429
with ``Retry-After``, before the engine sees it. Metrics by modality are counted here.
"""

from __future__ import annotations

import math
import threading
import time

from gateway.conversation.calls import Call
from gateway.conversation.form import ImageRef
from gateway.conversation.images import ImageLimits, RefusedImage, check_count, fetch_images
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle
from gateway.tenancy.limits import TokenBucket

IMAGE_TOKEN_WINDOW = 60.0  # seconds: image_tokens_per_minute refills over a minute

_buckets: dict[str, TokenBucket] = {}  # tenant -> its image-token bucket (this process)
_lock = threading.Lock()


def image_limits(call: Call) -> ImageLimits:
    """The server's image limits (the ``serve`` flags)."""
    c = call.front.config
    return ImageLimits(c.max_image_bytes, c.max_image_pixels, c.max_images, c.allow_image_urls,
                       c.image_fetch_timeout)


async def admit_images(call: Call, model: ModelHandle, refs: list[ImageRef]) -> tuple:
    """Check and fetch a request's images for ``model``; the ``images`` argument of
    :func:`gateway.conversation.prepare.prepare_chat`.

    Raises:
        APIError: 400 when the model reads no images; what :func:`check_count` and
            :func:`fetch_images` raise (counted in ``mlx_gateway_images_refused``).
    """
    refused = call.front.metrics.images_refused
    if model.kind != "vision":
        refused.labels(call.tenant.name, "not_vision").inc()
        raise APIError(400, f"the model '{model.name}' does not accept images: send text only", param=refs[0].param)
    limits = image_limits(call)
    try:
        check_count(refs, limits)
        fetched = await fetch_images(refs, limits)
    except RefusedImage as e:
        refused.labels(call.tenant.name, e.reason).inc()
        raise
    return refs, fetched, limits


def charge_image_tokens(call: Call, model: ModelHandle, images: list) -> None:
    """Count a prompt's images in the metrics and charge their tokens to the tenant.

    Raises:
        APIError: 429 ``rate_limit_exceeded`` (with ``Retry-After``) over the tenant's
            ``image_tokens_per_minute``.
    """
    tenant, m = call.tenant, call.front.metrics
    n = sum(im.tokens for im in images)
    limit = tenant.image_tokens_per_minute
    if limit:
        now = time.monotonic()
        with _lock:
            bucket = _buckets.get(tenant.name)
            if bucket is None:
                bucket = _buckets[tenant.name] = TokenBucket(limit, limit / IMAGE_TOKEN_WINDOW, now)
            elif bucket.capacity != limit:
                bucket.resize(limit, limit / IMAGE_TOKEN_WINDOW)
            if n > bucket.capacity:
                m.images_refused.labels(tenant.name, "rate_limited").inc()
                raise APIError(413, f"the request's images take {n} tokens; this key's image_tokens_per_minute "
                               f"is {limit}", param="messages", code="image_tokens_exceeded")
            wait = bucket.wait_for(n, now)
            if wait > 0:
                m.images_refused.labels(tenant.name, "rate_limited").inc()
                m.rate_limited.labels(tenant.name, "image_tokens").inc()
                raise APIError(429, f"image token limit reached ({limit} per minute): retry in {math.ceil(wait)} s",
                               code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
            bucket.take(n)
    labels = (tenant.name, model.name, call.api)
    m.image_requests.labels(*labels).inc()
    m.images.labels(*labels).inc(len(images))
    m.image_tokens.labels(*labels).inc(n)
