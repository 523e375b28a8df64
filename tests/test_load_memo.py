"""A model loaded again from the same files in the same process takes its probes' outcomes
from the earlier load (``gateway.models.load_memo``): the same decisions, none of the
measurements; other files, or other settings that change the outcomes, measure again."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import _MODEL_CACHE, free_port, model_path, start_gateway
from gateway.backend import backend
from gateway.config import ServeConfig
from gateway.cpu import weights
from gateway.models import load_memo, loader
from gateway.models.demo_model import build_model_dir
from gateway.models.spec import ModelSpec
from scheduler.batch import equivalence, forward_cost

REUSED = "reused the measurements of an earlier load"


@pytest.fixture
def counted(monkeypatch):
    """Calls of each probe, by name, from now on (an empty memo to start)."""
    calls = {"batch_is_exact": 0, "measure_forward_cost": 0, "rollback_refusal": 0}

    def counting(owner, name):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    counting(equivalence, "batch_is_exact")
    counting(forward_cost, "measure_forward_cost")
    counting(loader, "rollback_refusal")
    load_memo.forget()
    yield calls
    load_memo.forget()


def decisions(handle) -> dict:
    core = handle.engine.core
    return {"exact": not handle.engine.pad_free_prefill, "cost": core.chunks.cost,
            "speculates": core.batch.speculation.enabled,
            "dtypes": sorted({str(p.dtype) for _, p in tree_flatten(handle.engine.model.parameters())})}


def loads(paths: list, caplog, **spec) -> list[tuple[dict, list[str]]]:
    """Load each of ``paths`` in turn as one model of one gateway (unloading the one
    before); each load's decisions and what it logged about speculation and reuse."""
    specs = [ModelSpec(name=f"m{i}", path=str(p), **spec) for i, p in enumerate(paths)]
    gw = start_gateway(ServeConfig(port=free_port()), specs)
    out = []
    try:
        for s in specs:
            slot = gw.models.find(s.name)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="mlx_gateway"):
                handle = gw.models.load(slot).result(120)
            said = [r.getMessage() for r in caplog.records if "speculative" in r.getMessage() or REUSED in r.getMessage()]
            out.append((decisions(handle), said))
            gw.models.unload(slot)
    finally:
        gw.stop()
    return out


def test_the_same_files_loaded_again_decide_alike_without_measuring(counted, caplog):
    """Nemotron-H (its padded batches are not exact, its layers do not roll back a draft):
    the second load of its files makes every decision of the first, having run none of the
    probes, and says so once; a qwen3 (other files) then measures."""
    nemotron, qwen3 = model_path("nemotron_h"), model_path("qwen3")
    (first, said_first), (second, said_second), (other, said_other) = loads([nemotron, nemotron, qwen3], caplog)
    assert first == second and not first["exact"] and not first["speculates"]
    assert first["cost"] is not None
    assert counted == {"batch_is_exact": 2, "measure_forward_cost": 2, "rollback_refusal": 2}  # nemotron's, qwen3's
    assert not any(REUSED in m for m in said_first + said_other)
    assert sum(REUSED in m for m in said_second) == 1
    refused = [[m.split(": ", 1)[1] for m in said if "speculative decoding is off" in m]
               for said in (said_first, said_second)]
    assert refused[0] == refused[1] != []  # for the same reason
    assert other["exact"] and other["speculates"]


def test_other_settings_measure_again(counted, caplog):
    """The same files with a quantized KV cache are probed again (quantizing changes the
    layers' caches): nothing of the float cache's load is reused."""
    path = build_model_dir(_MODEL_CACHE / "qwen3-hd64", "qwen3", overrides={"head_dim": 64})  # as test_kv_quant's
    loads([path], caplog)
    (quantized, said), = loads([path], caplog, kv_bits=8)
    assert counted["batch_is_exact"] == 2 and counted["rollback_refusal"] == 2
    assert not any(REUSED in m for m in said)



@pytest.mark.skipif(backend().kind != "cpu", reason="applies where MLX runs on the CPU")
@pytest.mark.parametrize("faster", ["float32", "as stored"])
def test_the_weights_decision_is_applied_again(quantized_dir, counted, monkeypatch, caplog, faster):
    """A quantized model whose float32 weights measured faster (or slower) is converted (or
    left quantized) at its second load too, its layer not measured again."""
    timings, measured = {f"{kind} {shape}": (0.001 if (kind == "float32") == (faster == "float32") else 0.01)
                         for kind in ("stored", "float32") for shape in ("prefill", "decode")}, []
    monkeypatch.delenv("MLX_GATEWAY_CPU_FLOAT32", raising=False)
    monkeypatch.setattr(weights, "measure_layer", lambda layer, rounds=3: measured.append(layer) or timings)
    (first, _), (second, said) = loads([quantized_dir, quantized_dir], caplog)
    assert len(measured) == 1
    assert first == second and (first["dtypes"] == [str(mx.float32)]) == (faster == "float32")
    assert sum(REUSED in m for m in said) == 1


def test_directories_of_one_tokenizer_share_it(tmp_path):
    """A copy of a model directory (its weights left out, another path) is served with the
    tokenizer parsed for the first; a copy whose tokenizer files differ parses its own."""
    import shutil

    src = model_path("qwen3")
    config = json.loads((src / "config.json").read_text())
    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 1234}))
    made = loader.tokenizer_and_grammars
    first = made(src, config, 4096)
    assert made(same, config, 4096) is first
    assert load_memo.kept_tokenizer(same) is first[0]
    assert made(other, config, 4096) is not first
    assert made(src, {**config, "eos_token_id": 7}, 4096) is not first
