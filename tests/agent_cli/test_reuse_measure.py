"""The reuse measure the agent sessions assert on: each request's ideal is the longest
token prefix it shares with a request that started before it, capped one token short of
its prompt; records without a prompt (refused requests) are left out."""

from __future__ import annotations

from .reuse import reuse_rows, table, totals


class Words:
    """A tokenizer whose tokens are words (their hash), enough to count shared prefixes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) for w in text.split()]


def record(prompt: str | None, started: float, cached: int = 0) -> dict:
    n = len(prompt.split()) if prompt else 0
    return {"endpoint": "chat", "status": 200 if prompt else 400, "prompt": prompt, "prompt_tokens": n,
            "cached_tokens": cached, "ttft_seconds": 0.1, "started": started}


def test_the_ideal_is_the_longest_prefix_shared_with_an_earlier_request():
    records = [
        record("sys tools user2 more", 3.0, cached=3),  # logged first, started third
        record("sys tools user1", 1.0),
        record(None, 1.5),  # a refused request: no prompt
        record("sys other", 2.0, cached=1),
        record("sys tools user1", 4.0, cached=2),  # the same prompt again: all but its last token
    ]
    rows = reuse_rows(records, Words())
    assert [r.ideal for r in rows] == [0, 1, 2, 2]
    assert [r.prompt_tokens for r in rows] == [3, 2, 4, 3]
    assert totals(rows) == (12, 6, 5)
    assert "| | **total** | 12 | 6 | 5 | 120.0% of ideal |" in table("t", rows)
