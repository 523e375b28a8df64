"""Whether drafting pays: each row's acceptance rate, and the width of the step.

A verification forward of ``W = 1 + K`` positions costs more than a plain decode step:
on the 2-core CPU this was built on, a 135M model (30 layers, 1,500 tokens of context)
took 71 ms for ``[1, 1]`` and 101 ms for ``[1, 5]``, 129 ms for ``[4, 1]`` and 203 ms
for ``[4, 5]``: about 10-15 % more per extra position (``benchmarks/bench_speculative.py``
prints it). :class:`StepCost` keeps that ratio, measured on the running machine, and
:func:`best_width` widens a step only as far as the tokens its drafts are expected to
add outweigh it.

A row's drafts are expected to add ``c_1 + c_1 c_2 + ... + c_1 ... c_k`` tokens for ``k``
drafts, where ``c_j`` is the rate at which its ``j``-th draft was accepted when the ones
before it were. With one rate ``a`` for every position this is Leviathan et al.'s ``a +
a^2 + ... + a^k`` (2023, "Fast Inference from Transformers via Speculative Decoding",
eq. 1, i.i.d. acceptance); but text copied from the context is accepted in runs (a copied
span, once it is right, stays right until it ends), so the later positions' rates are
higher than the first's, and one overall rate undervalues wide steps there.
"""

from __future__ import annotations

from typing import Optional

PRIOR_RATE = 0.5  # a new row's assumed acceptance rate
DECAY = 0.9  # weight of the past in a row's rate, per verification
MIN_RATE = 0.15  # below this a row stops drafting for a while
COOLDOWN_STEPS = 16  # steps a row waits before drafting again (doubles each time, up to 256)


MIN_PRIOR = 0.05  # the least a new row is assumed to accept
EXPLORE_EVERY = 8  # one new row in this many starts from PRIOR_RATE whatever the others did


POSITIONS = 16  # draft positions whose acceptance is kept apart (the most K allows)


class RowAcceptance:
    """One row's acceptance of drafted tokens (decayed counts), overall and per draft
    position (see the module docstring), and its cool-down.

    Args:
        prior: the rate assumed before the row's first verification (and again after a
            cool-down), at every position: :data:`PRIOR_RATE`, or what recent rows
            accepted (:class:`BatchAcceptance`).
    """

    __slots__ = ("drafted", "accepted", "wait", "cooldown", "prior", "tried", "kept")

    def __init__(self, prior: float = PRIOR_RATE) -> None:
        self.prior = prior
        self.drafted = 2.0  # pseudo-counts holding the prior
        self.accepted = 2.0 * prior
        self.tried = [0.0] * POSITIONS  # position j: verified with every draft before it accepted
        self.kept = [0.0] * POSITIONS  # ... and accepted
        self.wait = 0  # steps left before drafting again
        self.cooldown = COOLDOWN_STEPS

    @property
    def rate(self) -> float:
        """Accepted over drafted tokens, recent verifications weighing most."""
        return self.accepted / self.drafted

    def expected(self, k: int) -> float:
        """Tokens ``k`` drafts are expected to add: ``sum_j prod_{i <= j} c_i``. Each
        position's rate holds two pseudo-counts of the one before it (the first's, of the
        prior), so a position never verified yet is expected to do as the last one that was."""
        total, run, c = 0.0, 1.0, self.prior
        for j in range(min(k, POSITIONS)):
            c = (self.kept[j] + 2.0 * c) / (self.tried[j] + 2.0)
            run *= c
            total += run
        return total

    def may_draft(self) -> bool:
        """False while cooling down after a low rate (counts one step of it)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: ``accepted`` of ``drafted`` tokens were right."""
        if drafted <= 0:
            return
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted
        for j in range(min(drafted, accepted + 1, POSITIONS)):  # positions verified after accepted ones
            self.tried[j] = DECAY * self.tried[j] + 1.0
            self.kept[j] = DECAY * self.kept[j] + (1.0 if j < accepted else 0.0)
        if self.rate < MIN_RATE:
            self.wait = self.cooldown
            self.cooldown = min(256, self.cooldown * 2)
            self.drafted, self.accepted = 2.0, 2.0 * self.prior  # a fresh start after the wait
            self.tried, self.kept = [0.0] * POSITIONS, [0.0] * POSITIONS
        elif accepted:
            self.cooldown = COOLDOWN_STEPS


class BatchAcceptance:
    """The acceptance rate over every row's recent verifications: the prior of new rows of
    a draft model (which drafts for every row), so that when its drafts fail for everyone
    (text it does not predict, sampled at a high temperature) new rows do not each pay to
    find out. One new row in
    :data:`EXPLORE_EVERY` starts from :data:`PRIOR_RATE` instead, so a workload that
    changes is noticed."""

    def __init__(self) -> None:
        self.drafted, self.accepted = 2.0, 2.0 * PRIOR_RATE
        self._rows = 0

    def record(self, drafted: int, accepted: int) -> None:
        """One row's verification (as :meth:`RowAcceptance.record`)."""
        if drafted > 0:
            self.drafted = DECAY * self.drafted + drafted
            self.accepted = DECAY * self.accepted + accepted

    def new_row(self) -> RowAcceptance:
        """The acceptance of a row that starts drafting."""
        self._rows += 1
        if self._rows % EXPLORE_EVERY == 0:
            return RowAcceptance()
        return RowAcceptance(max(MIN_PRIOR, self.accepted / self.drafted))


class StepCost:
    """The extra cost of each drafted position in a decode step, relative to a plain
    step of the same batch size, measured from the steps themselves: ``beta`` in the
    verification forward (a ``[B, W]`` forward costs ``1 + beta (W - 1)`` plain steps) and
    ``draft`` in drafting it (a draft model's forwards; 0 for prompt lookup).

    ``beta`` depends on the batch size: on a compute-bound CPU a ``[4, W]`` forward costs
    relatively more than a ``[1, W]`` one (``benchmarks/bench_speculative.py`` prints both),
    so it is kept per batch size (:meth:`beta_at`), ``beta`` itself being the figure for
    sizes not measured yet."""

    def __init__(self, beta: float = 0.15, draft: float = 0.0):
        self.beta = beta
        self.draft = draft
        self._plain: dict[int, float] = {}  # batch size -> seconds of a plain step (EMA)
        self._beta: dict[int, float] = {}  # batch size -> beta measured at that size (EMA)
        self._extra: dict[tuple[int, int], float] = {}  # (batch, width) -> seconds over a plain step's, relative

    def beta_at(self, batch: int) -> float:
        """``beta`` measured for ``batch`` rows, else the overall figure."""
        return getattr(self, "_beta", {}).get(batch, self.beta)

    def relative(self, batch: int, width: int) -> float:
        """What a step of ``width`` positions over ``batch`` rows costs, in plain steps of
        that batch: measured for that width when it was, else the line through the widths
        measured at that size (two or more), else the one measured width plus ``beta`` per
        position more or less, else ``1 + beta_at(batch) (width - 1)``. A verify step has a
        fixed part too (its graph built without overlap, its processors and rollback), which
        ``beta`` alone would spread over its positions, making wide steps look dearer than
        they are."""
        if width <= 1:
            return 1.0
        measured = sorted((w, y) for (b, w), y in getattr(self, "_extra", {}).items() if b == batch)
        for w, y in measured:
            if w == width:
                return 1.0 + y
        if len(measured) >= 2:
            xs, ys = [w - 1 for w, _ in measured], [y for _, y in measured]
            mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx_) ** 2 for x in xs)
            slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else self.beta
            return 1.0 + max(0.0, my + max(0.0, slope) * (width - 1 - mx_))
        if measured:
            w, y = measured[0]
            return 1.0 + max(0.0, y + min(self.beta, 0.15) * (width - w))
        return 1.0 + self.beta_at(batch) * (width - 1)

    def plain(self, batch: int, seconds: float) -> None:
        """A plain decode step of ``batch`` rows took ``seconds``."""
        old = self._plain.get(batch)
        self._plain[batch] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def wide(self, batch: int, width: int, seconds: float, draft_seconds: float | None = None) -> None:
        """A verification forward ``[batch, width]`` took ``seconds``; ``draft_seconds``:
        what its draft model took per drafted position (one forward ``[B_d, 1]``, without
        catching up or joining rows; a plain step's time, when none was measured for this
        batch size, is then estimated from this step's)."""
        if width <= 1:
            return
        base = self._plain.get(batch)
        if base is not None and base > 0:
            observed = min(2.0, max(0.0, (seconds / base - 1.0) / (width - 1)))
            self.beta = 0.8 * self.beta + 0.2 * observed
            old = self._beta.get(batch)
            self._beta[batch] = observed if old is None else 0.8 * old + 0.2 * observed
            extra = min(4.0, max(0.0, seconds / base - 1.0))
            old = self._extra.get((batch, width))
            self._extra[(batch, width)] = extra if old is None else 0.8 * old + 0.2 * extra
        if draft_seconds is not None:
            base = base or seconds / (1.0 + self.beta * (width - 1))
            observed = max(0.0, draft_seconds) / base
            self.draft = 0.8 * self.draft + 0.2 * min(observed, 2.0)


def best_width(drafts: list[int], rows: list[RowAcceptance], beta) -> int:
    """The step width ``W`` (1: a plain step) with the most expected tokens per unit of
    cost, for rows offering ``drafts[i]`` tokens each, over every row of the batch (rows
    offering none pay for the width too). ``beta``: a step of width ``W`` costs ``1 +
    beta (W - 1)`` plain steps; or a function of ``W`` giving that cost
    (:meth:`StepCost.relative`)."""
    batch = len(drafts)
    cost = beta if callable(beta) else (lambda w: 1.0 + beta * (w - 1))
    best, best_value = 1, float(batch)
    for width in range(2, max(drafts, default=0) + 2):
        gain = sum(r.expected(min(k, width - 1)) for k, r in zip(drafts, rows) if k)
        value = (batch + gain) / cost(width)
        if value > best_value * 1.02:  # a clear win only
            best, best_value = width, value
    return best


MIN_STEPS = 3  # verify steps of a batch size before their rate is given, and before a gain resets the backoff
DECAY_RATE = 0.9  # weight of the past in a rate, per step
BACKOFF_STEPS = 32  # decode steps a batch size stays plain after its verify steps lost (doubles while they do)
MAX_BACKOFF_STEPS = 256  # the longest pause: a re-measurement that loses again costs under 1 % of it
LOSS_MARGIN = 0.03  # verify steps lose when their tokens/s is below plain steps' by more than this
LOSS_STEPS = 2.0  # plain steps' time the verify steps of a batch size may lose (CUSUM) before it pauses
PROBE_EVERY = 64  # verify steps of a batch size after which plain steps are measured again


class RealizedRate:
    """Tokens per second that decode steps actually delivered, plain and verifying, per
    batch size: the check that speculation pays, whatever the width rule's model says.

    Each step is timed as it runs in the engine (no extra wait): a plain step from its call
    to its return (mlx-lm's pipelining makes that about one forward in steady state), a
    verify step likewise (its forward is waited for).

    A loss is judged by Page's CUSUM ("Continuous Inspection Schemes", Biometrika, 1954)
    over the verify steps of a batch size: each adds the seconds it took beyond what plain
    steps, at their measured rate less :data:`LOSS_MARGIN`, would have needed for the
    tokens it delivered (negative when it gained), the sum never below zero. When the sum
    passes :data:`LOSS_STEPS` plain steps' time, that size stays plain for
    :data:`BACKOFF_STEPS` steps (doubling while it keeps losing, up to
    :data:`MAX_BACKOFF_STEPS`), then measures again from scratch. A few slow verify steps
    (the first drafts of rows that just joined) thus cost what they cost and no more; a
    steady loss of 10 % pauses after about 20 steps, a verify step taking twice a plain
    one's time for the same tokens after 3.

    While every row drafts, no plain step runs to compare with: so when a batch size has no
    plain figure, or :data:`PROBE_EVERY` verify steps ran since its last one, two plain
    steps run (:meth:`probe`), the second timed (the first finds no forward of its own to
    wait for after a verify step, which would flatter it)."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, int], list[float]] = {}  # (kind, batch) -> [tokens, seconds, steps]
        self._lost: dict[int, float] = {}  # batch size -> CUSUM of seconds lost by verify steps
        self._pause: dict[int, int] = {}  # batch size -> plain steps left
        self._backoff: dict[int, int] = {}
        self._since_plain: dict[int, int] = {}  # batch size -> verify steps since its last timed plain step
        self._probing: dict[int, int] = {}  # batch size -> probe steps left

    def record(self, kind: str, batch: int, tokens: int, seconds: float) -> None:
        """A ``kind`` (``"plain"`` or ``"verify"``) step of ``batch`` rows delivered
        ``tokens`` tokens in ``seconds``."""
        s = self._sums.setdefault((kind, batch), [0.0, 0.0, 0])
        s[0], s[1], s[2] = DECAY_RATE * s[0] + tokens, DECAY_RATE * s[1] + seconds, s[2] + 1
        if kind == "plain":
            self._since_plain[batch] = 0
            return
        self._since_plain[batch] = self._since_plain.get(batch, PROBE_EVERY) + 1
        plain = self.rate("plain", batch)
        if not plain:  # none measured, or plain steps that delivered nothing (rows ending): no yardstick
            return
        lost = max(0.0, self._lost.get(batch, 0.0) + seconds - tokens / (plain * (1.0 - LOSS_MARGIN)))
        self._lost[batch] = lost
        if lost > LOSS_STEPS * batch / plain:
            wait = self._backoff.get(batch, BACKOFF_STEPS)
            self._pause[batch] = wait
            self._backoff[batch] = min(MAX_BACKOFF_STEPS, 2 * wait)
            self._lost[batch] = 0.0
            del self._sums[("verify", batch)]  # measured afresh after the pause
        elif lost == 0.0 and s[2] >= MIN_STEPS:
            self._backoff.pop(batch, None)  # paying again: the next loss pauses briefly

    def rate(self, kind: str, batch: int) -> Optional[float]:
        """Tokens/s of ``kind`` steps of ``batch`` rows (recent steps weighing most); None
        before :data:`MIN_STEPS` of them (plain: one)."""
        s = self._sums.get((kind, batch))
        if s is None or s[1] <= 0 or s[2] < (MIN_STEPS if kind == "verify" else 1):
            return None
        return s[0] / s[1]

    def lost(self, batch: int) -> float:
        """Seconds the verify steps of ``batch`` rows lost against plain steps, as the
        CUSUM stands (0: none, or they gained since)."""
        return self._lost.get(batch, 0.0)

    def probe(self, batch: int) -> Optional[bool]:
        """None: no probe now; else this step of ``batch`` rows is a plain one, timed
        (True, the second of the two) or not (False)."""
        left = self._probing.get(batch, 0)
        if left == 0 and self._since_plain.get(batch, PROBE_EVERY) >= PROBE_EVERY:
            left = 2
        if left == 0:
            return None
        self._probing[batch] = left - 1
        return left == 1

    def paused(self, batch: int) -> bool:
        """``batch`` rows stay plain this step (counts one step of a pause)."""
        left = self._pause.get(batch, 0)
        if left <= 0:
            return False
        self._pause[batch] = left - 1
        return True
