"""Admission, batching and the engine thread that owns every MLX call."""

from scheduler.engine import Engine, EngineDead, EngineOverloaded
from scheduler.request import EngineRequest, SamplingParams

__all__ = ["Engine", "EngineDead", "EngineOverloaded", "EngineRequest", "SamplingParams"]
