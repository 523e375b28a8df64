"""One served model's place in the registry (:class:`Slot`), and the error of a model that
cannot be served now (:class:`ModelUnavailable`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from gateway.models.handle import ModelHandle
from gateway.models.spec import ModelSpec
from scheduler.lora import adapters_of

RETRY_AFTER = 5  # seconds a client is told to wait when a model cannot be loaded now


class ModelUnavailable(RuntimeError):
    """A model could not be loaded (HTTP 503; ``retry_after`` seconds when waiting helps)."""

    def __init__(self, message: str, code: str = "model_unavailable", retry_after: Optional[int] = RETRY_AFTER):
        super().__init__(message)
        self.message, self.code, self.retry_after = message, code, retry_after


@dataclass(eq=False)
class Slot:
    """One served model's place in the registry (see the module docstring)."""

    spec: ModelSpec
    state: str = "unloaded"  # unloaded | loading | loaded | unloading
    handle: Optional[ModelHandle] = None
    loading: Optional[Future] = None  # the load in progress: its result is the handle
    error: Optional[str] = None  # why the last load failed
    in_flight: int = 0
    last_used: float = 0.0  # monotonic seconds of its last hold or release
    last_used_wall: Optional[float] = None
    reserved: int = 0  # bytes a load in progress holds under the budget
    unloaded: threading.Event = field(default_factory=threading.Event)  # set unless unloading
    kind: Optional[str] = None  # text | vision | embedding: the spec's, else found at its first load
    keep_alive: Optional[float] = None  # seconds idle before unloading: the spec's, or a request's (keep_for)

    def __post_init__(self) -> None:
        self.unloaded.set()
        self.kind = self.spec.kind
        self.keep_alive = self.spec.keep_alive

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def weights(self) -> int:
        """Bytes its weights hold (a load's reservation), its resident LoRA adapters included."""
        if self.handle is None:
            return self.reserved
        lora = adapters_of(getattr(self.handle.engine, "model", None))
        return self.handle.weights_bytes + (lora.nbytes if lora is not None else 0)
