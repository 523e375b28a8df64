"""docs/models.md's "What fits on a Mac" table is what gateway/models/sizing.py computes
with the admission rule of scheduler/admission/memory.py."""

from __future__ import annotations

from pathlib import Path

from gateway.models.sizing import MODELS, mac_row, markdown
from scheduler.admission.memory import MemoryGate

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
