"""The table of layer-cache kinds (``cache/kinds.py``): every class the test architectures'
caches hold, per sequence and in a decode batch, float and quantized, has a row of its own,
and every strategy a row names is one its reader carries out."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache.kinds import KINDS, UNKNOWN, CacheKind, batch_kind_of, kind_of
from cache.quantized import quantize_kv
from conftest import load_model, model_path
from scheduler.batch_merge import _MERGES, merge_with_room
from scheduler.speculative.rewind import REPLAYED

ARCHS = ["qwen3", "llama", "qwen3_5", "gemma3_text", "mamba2", "nemotron_h"]


def classes(layers) -> set[type]:
    """The classes of ``layers`` and of the members of their ``CacheList`` layers."""
    out = set()
    for c in layers:
        out.add(type(c))
        out |= classes(getattr(c, "caches", ()) or ())
    return out


def cache_classes(model) -> set[type]:
    """The classes of two prompts' caches, each alone (the prefix cache stores these) and
    merged into one decode batch (as ``scheduler.batch_merge`` merges them)."""
    rows = []
    for n in (5, 9):
        cache = make_prompt_cache(model)
        model(mx.arange(1, n + 1)[None], cache=cache)
        rows.append(cache)
    return classes(rows[0]) | classes(merge_with_room(rows))


def row_of(cls: type) -> CacheKind:
    """The row naming ``cls`` itself (its name, or its name as a batch form): no base's."""
    found = KINDS.get(cls.__name__) or next((k for k in KINDS.values() if k.batch == cls.__name__), None)
    assert found is not None, f"{cls.__name__} has no row in cache.kinds.KINDS"
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cache_class_of_the_test_architectures_has_a_row(arch):
    model = load_model(model_path(arch))
    for cls in cache_classes(model):
        row_of(cls)


def test_quantized_caches_have_rows():
    from test_kv_quant import wide_head_model

    model = load_model(wide_head_model("qwen3"))  # head size 64: one quantization group
    quantize_kv(model, 8)
    found = cache_classes(model)
    assert {c.__name__ for c in found} == {"QuantizedKVRow", "BatchQuantizedKVCache"}
    for cls in found:
        assert row_of(cls).name == "QuantizedKVRow"


def test_lookup_by_name_batch_form_and_base():
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    from scheduler.speculative.holes import HoledKVCache

    from cache.pages import PagedKVCache
    from cache.quantized import BatchQuantizedKVCache, QuantizedKVRow

    assert batch_kind_of(BatchKVCache([0])).name == "KVCache"
    assert batch_kind_of(BatchRotatingKVCache(8, [0])).rollback == "window"
    assert batch_kind_of(HoledKVCache([0])).rollback == "mask"  # by its base, BatchKVCache
    assert batch_kind_of(BatchQuantizedKVCache([0])).name == "QuantizedKVRow"
    assert kind_of(BatchKVCache([0])) is UNKNOWN  # a batch is no row: restored exactly only, never paged
    assert kind_of(PagedKVCache([], [])).disk == "kv" and kind_of(QuantizedKVRow()).paged
    assert kind_of(object()) is UNKNOWN and UNKNOWN.restore == "exact" and UNKNOWN.rollback is None


def test_every_strategy_a_row_names_is_carried_out():
    for k in KINDS.values():
        assert k.restore in ("any", "window", "exact", "members"), k
        assert k.disk in ("state", "quantized", "kv"), k
        assert k.merge == "mlx" or k.merge in _MERGES, k
        assert k.rollback in (None, "mask", *REPLAYED), k
        assert not k.quantize or k.restore == "any", k  # a quantized row (QuantizedKVRow) trims
