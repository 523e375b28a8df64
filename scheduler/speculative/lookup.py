"""Prompt lookup drafting: the tokens that followed the latest earlier occurrence of a
row's last ``n`` tokens in its own prompt and output.

This is "prompt lookup decoding" (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding),
vLLM's ``ngram`` speculative method (``prompt_lookup_max`` / ``prompt_lookup_min``): the
longest suffix from ``max_n`` down to ``min_n`` tokens that occurred before wins. Agents
often write text that repeats their context (an edited file, quoted code, JSON echoing
its inputs), which these drafts predict.

The index maps each n-gram to the position of the token that followed its latest
occurrence, so proposing a draft is one dictionary lookup per ``n`` and extending the
context costs ``O(max_n - min_n + 1)`` per token.
"""

from __future__ import annotations

from collections.abc import Sequence


BULK = 32  # tokens synced at once above which they are indexed in bulk (PromptLookup._extend)


class PromptLookup:
    """Drafts for one row from its own tokens (prompt, then output).

    Args:
        min_n, max_n: the n-gram lengths tried, longest first (tokens).

    Use :meth:`sync` with the row's token list (it only grows; tokens already indexed
    are not read again), then :meth:`propose`.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # hash of an n-gram -> index of the token after its latest occurrence (a hash, not the
        # tuple, to halve the memory; a collision only makes a draft that verification rejects)
        self._follow: dict[int, int] = {}

    def sync(self, tokens: Sequence[int]) -> None:
        """Index the tokens of ``tokens`` beyond those seen so far (``tokens`` extends the
        sequence given before)."""
        new = len(tokens) - len(self.tokens)
        if new > BULK:
            self._extend(list(tokens[len(self.tokens):]))
            return
        for t in tokens[len(self.tokens):]:
            self._append(t)

    def _extend(self, new: list[int]) -> None:
        """Index many tokens at once (a row's prompt): what :meth:`_append` of each would
        do, in loops that run in C (about 2.4x faster for a 900-token prompt here, on the
        engine thread between two decode steps). Later positions overwrite earlier ones,
        as one at a time."""
        old = len(self.tokens)
        toks = self.tokens
        toks.extend(new)
        end = len(toks) - 1  # the last token's n-grams end before a token that is not here yet
        for n in range(self.min_n, self.max_n + 1):
            first = max(old, n)  # positions p >= n whose preceding n-gram was not indexed yet
            if first > end:
                continue
            grams = zip(*(toks[first - n + i:end - n + 1 + i] for i in range(n)))
            self._follow.update(zip(map(hash, grams), range(first, end + 1)))

    def _append(self, token: int) -> None:
        toks = self.tokens
        p = len(toks)  # position of ``token``
        for n in range(self.min_n, self.max_n + 1):
            if p >= n:
                self._follow[hash(tuple(toks[p - n:p]))] = p
        toks.append(token)

    def matches(self) -> bool:
        """Some suffix of :attr:`tokens` (``min_n`` to ``max_n`` tokens) occurred before: a
        cheap sign, without the next input token, that :meth:`propose` may find a draft
        (in text that copies its context, it does)."""
        toks = self.tokens
        return any(len(toks) > n and hash(tuple(toks[len(toks) - n:])) in self._follow
                   for n in range(self.min_n, self.max_n + 1))

    def propose(self, last: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``last`` (the row's next input, not yet in
        :attr:`tokens`); empty when no suffix of ``tokens + [last]`` occurred before.

        A match close to the end continues periodically: the draft is what follows the
        match in ``tokens + [last] + draft`` (a loop of period ``p`` drafts ``k`` tokens
        of that loop, not just the ``p`` seen so far)."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) + 1 < n:
                continue
            key = (*toks[len(toks) - n + 1:], last) if n > 1 else (last,)
            pos = self._follow.get(hash(key))
            if pos is not None:
                draft = toks[pos:pos + k]
                seq_len = len(toks) + 1
                while len(draft) < k:  # the match runs into the end: continue with the period
                    j = pos + len(draft)
                    draft.append(last if j == seq_len - 1 else draft[j - seq_len])
                return draft
        return []


class LookupDrafter:
    """The ``ngram`` method over a decode batch: one :class:`PromptLookup` per row.

    The drafter interface :class:`scheduler.speculative.step.Speculator` uses:
    :meth:`hint`, :meth:`propose`, :meth:`settle`, :meth:`forget` and :meth:`kv_bytes`.
    """

    costly = False  # a draft is a few dictionary lookups: proposing costs nothing to speak of
    forward_seconds = None  # no forward to time (see ModelDrafter)

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._lookups: dict[int, PromptLookup] = {}

    def forget(self, uids: list[int]) -> None:
        """Drop the rows not in ``uids`` (they left the batch)."""
        if len(self._lookups) > len(uids):
            live = set(uids)
            for uid in [u for u in self._lookups if u not in live]:
                del self._lookups[uid]

    def kv_bytes(self) -> int:
        """Prompt lookup holds no KV cache."""
        return 0

    def hint(self, batch, i: int) -> bool:
        """Row ``i``'s tokens end in an n-gram seen before: it will likely find a draft
        (a check that does not wait for the row's pending token)."""
        lookup = self._lookups.get(batch.uids[i])
        if lookup is None:
            lookup = self._lookups[batch.uids[i]] = PromptLookup(self.min_n, self.max_n)
        lookup.sync(batch.tokens[i])
        return lookup.matches()

    def propose(self, batch, candidates: list[bool], inputs: list[int], rooms: list[int]) -> list[list[int]]:
        """Per row, up to ``rooms[i]`` tokens to follow ``inputs[i]`` (empty for rows not
        ``candidates``)."""
        return [self._lookups[batch.uids[i]].propose(t, room) if c else []
                for i, (t, c, room) in enumerate(zip(inputs, candidates, rooms))]

    def settle(self, uids: list[int], accepted: list[int]) -> None:
        """Nothing to take back: the lookup indexes only tokens a row emitted."""
