"""docs/models.md's "What fits on a Mac" table, computed here by the rules the server itself
uses, and checked against the docs.

The budget is :meth:`gateway.backend.Tuning.memory_budget` of that much memory (75 % of
it; on a running Mac the server takes Metal's recommended working set instead, which it
prints at start); a request's KV is its reservation, :meth:`scheduler.admission.memory.MemoryGate.held`
of its row (prompt and answer, padding, logits and a copy of its largest layer as the batch
grows, merged on one stream; Metal's fused attention keeps no scores), and
the prefix cache gets what the weights and the running rows leave (``cache/budget.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.backend import Tuning
from scheduler.admission.memory import KVShape, MemoryGate

GB = 1 << 30
MACS_GB = (8, 16, 24, 48, 128)
CONTEXT = 32768  # tokens: the "KV at a context" column
PREFILL_STEP = 2048  # --prefill-step-size's default (gateway/config.py)


@dataclass(frozen=True)
class Reference:
    """A model as the table sees it: weights (bytes) and its attention's KV shape."""

    name: str
    params: float  # parameters
    bits: int  # weight bits (with a float16 scale and bias per 64 weights)
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    context: int  # its context window, tokens

    @property
    def weights(self) -> int:
        return int(self.params * (self.bits + 32 / 64) / 8)

    def gate(self) -> MemoryGate:
        """Its :class:`MemoryGate` with float16 KV on Metal."""
        layer = 2 * self.kv_heads * self.head_dim * 2  # bytes a token of one layer
        return MemoryGate(KVShape(self.layers * layer, layer=layer), self.hidden, self.vocab, PREFILL_STEP)


# Llama 3.1 8B at 4 bits (32 layers, 8 KV heads of 128), Qwen3 30B-A3B at 4 bits (48 layers, 4 KV heads of 128).
MODELS = (Reference("Llama 3.1 8B, 4-bit", 8.03e9, 4, 32, 8, 128, 4096, 128256, 131072),
          Reference("Qwen3 30B-A3B, 4-bit", 30.5e9, 4, 48, 4, 128, 2048, 151936, 40960))


def mac_row(gb: int, model: Reference, context: int = CONTEXT) -> dict:
    """One Mac of ``gb`` GB with ``model``: its budget, the weights, one request's KV at
    ``context`` tokens, how many such requests run at once, the longest context one
    request may have (at most the model's window), and the prefix cache's room beside one such request (bytes, tokens)."""
    budget = Tuning("metal", gb * GB).memory_budget()
    gate = model.gate()
    room = budget - model.weights - gate.transient
    need = gate.held([(context, 0, 0)])  # n such rows hold n times it
    longest = 0
    if room > 0:  # the largest n whose row fits the room (a row's reservation grows with n)
        lo, hi = 0, model.context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if gate.held([(mid, 0, 0)]) <= room else (lo, mid - 1)
        longest = lo
    return {"mac_gb": gb, "budget": budget, "weights": model.weights, "kv": need,
            "requests": max(0, room // need), "longest": longest, "cache": max(0, room - need)}


def _gb(n: int) -> str:
    return f"{n / GB:.1f}"


def markdown(context: int = CONTEXT) -> str:
    """The docs' table: one line per Mac and model."""
    out = ["| Mac | budget GB | model | weights GB | KV of one request at "
           f"{context // 1024}k tokens, GB | such requests at once | longest context, tokens | "
           "prefix cache beside one, GB |", "|---|---|---|---|---|---|---|---|"]
    for gb in MACS_GB:
        for m in MODELS:
            r = mac_row(gb, m, context)
            if r["longest"] == 0:
                out.append(f"| {gb} GB | {_gb(r['budget'])} | {m.name} | {_gb(r['weights'])} | does not fit | | | |")
                continue
            out.append(f"| {gb} GB | {_gb(r['budget'])} | {m.name} | {_gb(r['weights'])} | {_gb(r['kv'])} | "
                       f"{r['requests']} | {r['longest']} | {_gb(r['cache'])} |")
    return "\n".join(out)


DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def test_the_docs_table_is_the_computed_one():
    assert markdown() in DOC.read_text(encoding="utf-8")


def test_a_row_is_the_admission_rule():
    m = MODELS[0]
    r = mac_row(16, m)
    gate: MemoryGate = m.gate()
    room = r["budget"] - r["weights"] - gate.transient
    assert r["kv"] == gate.held([(32768, 0, 0)]) > gate.need(32768, 0)  # a copy of a layer besides
    assert gate.held([(r["longest"], 0, 0)]) <= room < gate.held([(r["longest"] + 1, 0, 0)])
    assert gate.held([(32768, 0, 0)] * r["requests"]) == r["requests"] * r["kv"]
    assert r["requests"] * r["kv"] <= room < (r["requests"] + 1) * r["kv"]
