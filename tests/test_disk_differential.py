"""Differential tests of the disk tier: a prefix restored from disk, after a "restart"
(a new manager and a new disk tier on the same directory), gives the same logprobs
(within 1e-4) and the same 8 greedy tokens as a cold run, for every architecture;
both ways in: a snapshot evicted from memory (spilled while serving), and the
snapshots held at a graceful shutdown (``persist``).
"""

from __future__ import annotations

import pytest

from cache import PromptCacheManager
from cache.disk import DiskTier
from cache.disk_format import model_identity
from cache.tiering import DiskLink
from conftest import model_path
from test_cache_differential import ARCHS, check_equal, encode, lineage, load, prefill, text


def tiered(root, arch, max_bytes=1 << 30) -> PromptCacheManager:
    mgr = PromptCacheManager(max_bytes=max_bytes, max_entries=64)
    mgr.attach_disk(DiskLink(DiskTier(root, 1 << 30, model_identity(model_path(arch)))))
    return mgr


@pytest.mark.parametrize("arch", ARCHS)
def test_restart_restores_exactly_from_disk(arch, tmp_path):
    model, tok = load(arch)
    prompt = encode(tok, text(20, 200))[:180]  # longer than gemma3's 64-token window
    first = tiered(tmp_path, arch)
    stored = prefill(model, first, prompt)
    assert first.persist(timeout=30) >= 1

    again = tiered(tmp_path, arch)
    query = prompt + encode(tok, " " + text(21, 20))[:12]
    result = prefill(model, again, query)
    assert result.cached_tokens >= len(prompt) - 1  # the whole prompt, or all but its last token
    assert again.disk.tier.registry.get_sample_value(
        "mlx_gateway_prompt_cache_disk_reads_total", {"outcome": "hit"}) == 1
    check_equal(model, result, query, lineage(stored, upto=result.cached_tokens))
    again.sanity_check()
    again.persist(timeout=30)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_an_evicted_snapshot_is_served_from_disk(arch, tmp_path):
    model, tok = load(arch)
    a = encode(tok, text(30, 200))[:160]
    b = encode(tok, text(31, 200))[:160]
    probe = PromptCacheManager(max_bytes=1 << 30, max_entries=64)
    prefill(model, probe, a)
    mgr = tiered(tmp_path, arch, max_bytes=probe.nbytes + probe.nbytes // 4)  # room for one of a, b
    stored = prefill(model, mgr, a)
    prefill(model, mgr, b)  # evicts a's snapshots: they are written to disk
    assert mgr.match_length("default", a + [1]) < len(a) - 1
    assert mgr.disk.tier.flush(30) and mgr.disk.tier.num_entries >= 1
    query = a + encode(tok, " " + text(32, 20))[:12]
    result = prefill(model, mgr, query)
    assert result.cached_tokens >= len(a) - 1
    check_equal(model, result, query, lineage(stored, upto=result.cached_tokens))
    mgr.sanity_check()
    mgr.persist(timeout=30)
