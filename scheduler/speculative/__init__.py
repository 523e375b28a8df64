"""Speculative decoding inside continuous batching (engine thread only).

Each decode step may verify drafted tokens for every decoding row in one batched
forward ``[B, 1 + K]``; accepted tokens stream out, rejected ones are rolled back.

- :mod:`scheduler.speculative.lookup`: prompt lookup (n-gram) drafts from a row's own
  prompt and output.
- :mod:`scheduler.speculative.draft_model`: drafts from a small model of the same
  tokenizer, its own KV cache kept in step with the batch's rows.
- :mod:`scheduler.speculative.draft_snapshots`: the draft model's rows in the prefix
  cache, so that a next turn or a resumed row does not prefill its whole context again.
- :mod:`scheduler.speculative.holes`: the decode batch's KV cache with *holes*, so one
  row can roll back a rejected draft without moving the others (or its own KV).
- :mod:`scheduler.speculative.rewind`: rollback for recurrent and sliding-window layers
  (their state before the step, and a replay of the kept tokens).
- :mod:`scheduler.speculative.acceptance`: each row's acceptance rate and whether a
  draft is worth widening the step for.
- :mod:`scheduler.speculative.verify`: greedy verification and rejection sampling.
- :mod:`scheduler.speculative.step`: the speculative decode step itself.
"""

from typing import Optional

from scheduler.speculative.config import SpeculationConfig, rollback_refusal, speculation_refusal
from scheduler.speculative.draft_model import DraftModel
from scheduler.speculative.draft_snapshots import DraftSnapshots
from scheduler.speculative.step import SpeculationStats, Speculator

__all__ = ["DraftModel", "DraftSnapshots", "SpeculationConfig", "SpeculationStats", "Speculator", "rollback_refusal", "speculation_refusal",
           "speculator"]


def speculator(config: SpeculationConfig, stats: SpeculationStats, metrics, snapshots=None) -> Optional[Speculator]:
    """The decode batch's :class:`Speculator` for ``config`` (None when off), counting into
    ``stats`` and ``metrics`` (a :class:`scheduler.metrics.SchedulerMetrics`); a draft
    model's rows are kept in ``snapshots`` (a :class:`DraftSnapshots`), if given."""
    if not config.enabled:
        return None

    def on_verify(drafted: int, accepted: int, width: int) -> None:
        metrics.draft_tokens.inc(drafted)
        metrics.accepted_tokens.inc(accepted)
        metrics.verify_steps.inc()

    return Speculator(config, stats, on_verify, snapshots)
