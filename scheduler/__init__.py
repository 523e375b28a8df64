"""Admission, batching and the engine thread that owns every MLX call."""

from scheduler.engine import Engine
from scheduler.request import EngineRequest, SamplingParams
from scheduler.batch.rows import AdmissionRecord, EngineDead, EngineOverloaded, TenantQueueFull

__all__ = ["AdmissionRecord", "Engine", "EngineDead", "EngineOverloaded", "EngineRequest", "SamplingParams",
           "TenantQueueFull"]
