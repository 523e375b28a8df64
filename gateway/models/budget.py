"""The memory governor's rule: which idle models to unload so that a new one fits.

A gateway holds its loaded models under one memory budget (``--memory-budget``):
their weights, the KV of their running batches and their prefix caches together. A
model's *charge* is its weights plus its running KV (a model being loaded is charged the
bytes its weights will take, known from their shapes before they are read). The prefix
caches share what the charges leave (:class:`cache.CacheBudget`): they shrink, least
recently used snapshot first, as models are loaded, so they never stop a load.

To load a model, the least recently used loaded models that are idle (no request in
flight) and not pinned are unloaded until the charges fit the budget and the loaded
count fits ``--max-loaded-models``. When even that would not make room, nothing is
unloaded and the load is refused (503 with ``Retry-After``), naming the budget and what
holds it. The budget's default is the backend's (:meth:`gateway.backend.Tuning.memory_budget`:
75 % of the memory the process may use; on a Mac, Metal's recommended working set). This is the rule of vllm-mlx and oMLX (memory budget, LRU, pins) and of
ollama's ``OLLAMA_MAX_LOADED_MODELS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

@dataclass
class Holder:
    """A model that holds part of the budget, as the rule sees it.

    Attributes:
        name: its served name.
        charge: bytes it holds (weights and running KV; a load's reservation).
        last_used: monotonic seconds of its last request (0: never used).
        in_flight: requests holding it.
        pinned: it is never unloaded.
        loading: it is being loaded (never unloaded meanwhile).
    """

    name: str
    charge: int
    last_used: float = 0.0
    in_flight: int = 0
    pinned: bool = False
    loading: bool = False

    @property
    def evictable(self) -> bool:
        return not (self.pinned or self.loading or self.in_flight)


class NoRoom(RuntimeError):
    """A model cannot be loaded without unloading one that is pinned or busy; the message
    names the budget and what holds it."""


def gib(n: int) -> str:
    """Bytes as text for messages: ``1.25 GB``, ``30.5 MB``."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def plan_room(name: str, need: int, holders: Sequence[Holder], budget: int, max_loaded: int = 0) -> list[str]:
    """The models to unload, least recently used first, so that ``name`` fits.

    Args:
        name: the model to load.
        need: the bytes its weights will take.
        holders: the other models loaded or being loaded.
        budget: the memory budget (bytes).
        max_loaded: most models loaded at once (0: no limit).

    Returns:
        Names to unload (possibly none).

    Raises:
        NoRoom: even unloading every idle, unpinned model would not make room.
    """
    used = sum(h.charge for h in holders)
    count = len(holders)
    victims: list[str] = []
    for h in sorted((h for h in holders if h.evictable), key=lambda h: h.last_used):
        if used + need <= budget and not (max_loaded and count + 1 > max_loaded):
            break
        victims.append(h.name)
        used -= h.charge
        count -= 1
    if used + need > budget or (max_loaded and count + 1 > max_loaded):
        raise NoRoom(_refusal(name, need, holders, budget, max_loaded, used + need > budget))
    return victims


def _refusal(name: str, need: int, holders: Sequence[Holder], budget: int, max_loaded: int, bytes_short: bool) -> str:
    held = ", ".join(_describe(h) for h in holders) or "nothing else"
    if bytes_short:
        why = (f"it needs {gib(need)} and the memory budget of {gib(budget)} (--memory-budget) is held by {held}")
    else:
        why = f"--max-loaded-models {max_loaded} are loaded: {held}"
    return (f"cannot load the model '{name}': {why}; none of them can be unloaded now "
            "(pinned, loading or serving requests): retry later, or raise the limit")


def _describe(h: Holder) -> str:
    what = [gib(h.charge)]
    if h.pinned:
        what.append("pinned")
    if h.loading:
        what.append("loading")
    if h.in_flight:
        what.append(f"{h.in_flight} request{'s' if h.in_flight != 1 else ''} in flight")
    return f"'{h.name}' ({', '.join(what)})"
