"""Each of mlx-lm's private functions the project uses, through ``compat.mlx_lm``, behaves
as its callers rely on: what it takes and what it returns (on the tiny random models)."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import BatchKVCache

from compat import mlx_lm as compat
from conftest import model_path, prefilled


def test_every_private_name_of_mlx_lm_the_project_uses_comes_through_compat():
    """A private mlx-lm import outside compat/ fails here, naming the file (tests may
    reach mlx-lm's private parts to compare against them)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    private = re.compile(r"from mlx_lm[\w.]* import [^\n]*\b_[a-z]|mlx_lm[\w.]*\._[a-z]")
    found = [str(p.relative_to(root)) for pkg in ("cache", "scheduler", "gateway", "benchmarks", "deploy")
             for p in (root / pkg).rglob("*.py") if private.search(p.read_text())]
    assert found == [], f"private mlx-lm imports outside compat/: {found}"


def test_download_gives_a_local_directory_for_a_local_path():
    path = model_path("qwen3")
    assert list(inspect.signature(compat.download).parameters)[:1] == ["path_or_hf_repo"]
    got = compat.download(str(path))
    assert got.is_dir() and got.resolve() == path.resolve() and (got / "config.json").exists()


def test_get_classes_gives_the_model_and_its_arguments_for_a_config():
    import json

    config = json.loads((model_path("qwen3") / "config.json").read_text())
    model_class, args_class = compat.get_classes(config)
    assert model_class.__module__ == "mlx_lm.models.qwen3" and args_class.__name__ == "ModelArgs"
    assert isinstance(model_class(args_class.from_dict(config)), mlx_lm.models.qwen3.Model)
    with pytest.raises(ValueError):
        compat.get_classes({**config, "model_type": "no_such_model"})


def test_merge_caches_left_pads_sequences_into_one_batch_per_layer():
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    rows = [prefilled(model, [5, 6, 7]), prefilled(model, [8, 9, 10, 11, 12])]
    merged = compat.merge_caches(rows)
    assert len(merged) == len(rows[0]) and all(isinstance(c, BatchKVCache) for c in merged)
    first = merged[0]
    assert first.left_padding.tolist() == [2, 0] and first.keys.shape[0] == 2
    assert mx.array_equal(first.keys[1:, :, first._idx - 5:first._idx], rows[1][0].keys[..., :5, :])


def test_extend_cache_puts_the_second_batch_s_rows_after_the_first_s():
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    a = compat.merge_caches([prefilled(model, [5, 6, 7])])
    b = compat.merge_caches([prefilled(model, [8, 9])])
    assert compat.extend_cache([], b) is b and compat.extend_cache(a, []) is a
    out = compat.extend_cache(a, b)
    assert out is a and out[0].keys.shape[0] == 2 and out[0].left_padding.tolist() == [0, 1]


def test_byte_decoder_maps_gpt2_characters_to_every_byte():
    table = compat.byte_decoder()
    assert isinstance(table, dict) and sorted(table.values()) == list(range(256))
    assert table["!"] == ord("!") and table["Ā"] == 0

