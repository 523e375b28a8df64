"""Admission, batching and the engine thread that owns every MLX call."""

from scheduler.engine import AdmissionRecord, Engine, EngineDead, EngineOverloaded, TenantQueueFull
from scheduler.request import EngineRequest, SamplingParams

__all__ = [
    "AdmissionRecord", "Engine", "EngineDead", "EngineOverloaded", "EngineRequest", "SamplingParams",
    "TenantQueueFull",
]
