"""float32 weights where MLX runs on the CPU (``gateway.cpu.weights``): quantized layers
dequantized and half-precision parameters cast, with the same outputs up to float32
rounding; left alone when too large or turned off; and applied when a quantized model
is served."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_lm.models.switch_layers import SwitchLinear

from conftest import live_server, model_path
from gateway.backend import backend
from gateway.cpu.weights import decide, float32_bytes, float32_weights

PROMPT = mx.array([[5, 17, 99, 300, 42, 7, 650, 12]])


def quantized_layers(model) -> int:
    return sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def dtypes(model) -> set:
    return {p.dtype for _, p in tree_flatten(model.parameters())}


def logprobs(model) -> mx.array:
    logits = model(PROMPT).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.fixture
def quantized():
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    full = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    return model, full


def test_dequantized_model_gives_the_quantized_outputs(quantized):
    model, full = quantized
    assert quantized_layers(model) > 0
    assert float32_bytes(model) == full  # what the float32 model took before quantizing
    want = logprobs(model)
    assert float32_weights(model, limit_bytes=1 << 30) is None
    assert quantized_layers(model) == 0 and dtypes(model) == {mx.float32}
    assert float(mx.max(mx.abs(logprobs(model) - want))) < 1e-4


def test_half_precision_is_cast_to_float32():
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    model.set_dtype(mx.float16)
    want = logprobs(model)
    assert float32_weights(model, limit_bytes=1 << 30) is None
    assert dtypes(model) == {mx.float32}
    assert float(mx.max(mx.abs(logprobs(model) - want))) < 0.05  # float16 rounding of the activations


class Layers(nn.Module):
    """One of each layer kind the conversion handles, with biases and an integer parameter."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 32, bias=True)
        self.embedding = nn.Embedding(50, 64)
        self.experts = SwitchLinear(64, 32, 4, bias=True)
        self.step = mx.array([3], dtype=mx.int32)

    def __call__(self, x: mx.array, ids: mx.array) -> list[mx.array]:
        return [self.linear(x), self.embedding(ids), self.experts(x[:, None, :], ids[:, None] % 4)]


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_every_layer_kind_and_mode_half_precision_scales(mode):
    mx.random.seed(0)
    model = Layers()
    model.set_dtype(mx.float16)  # float16 weights, so float16 scales
    full = sum(4 * p.size if p.dtype == mx.float16 else p.nbytes for _, p in tree_flatten(model.parameters()))
    nn.quantize(model, group_size=32, bits=4, mode=mode)
    assert quantized_layers(model) == 2 and type(model.experts).__name__ == "QuantizedSwitchLinear"
    assert float32_bytes(model) == full
    x, ids = mx.random.normal((3, 64)).astype(mx.float16), mx.array([1, 7, 30])
    want = model(x, ids)
    assert float32_weights(model, limit_bytes=1 << 30) is None
    assert dtypes(model) == {mx.float32, mx.int32} and model.step.item() == 3
    assert type(model.experts) is SwitchLinear and quantized_layers(model) == 0
    for a, b in zip(want, model(x.astype(mx.float32), ids)):
        assert float(mx.max(mx.abs(a.astype(mx.float32) - b))) < 1e-2  # float16 activations before


class FusedQuantizedLinear(nn.QuantizedLinear):
    """A subclass with its own call, as some model files have (afm7's fused QKV)."""


def test_subclassed_quantized_layers_are_left_alone():
    model = Layers()
    nn.quantize(model, group_size=32, bits=4)
    model.linear = FusedQuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    why = float32_weights(model, limit_bytes=1 << 30)
    assert why == "unsupported quantized layers: FusedQuantizedLinear"
    assert type(model.linear) is FusedQuantizedLinear and quantized_layers(model) == 2


def test_left_alone_when_too_large_or_already_float32(quantized):
    model, full = quantized
    assert float32_weights(model, limit_bytes=full - 1).startswith("too large")
    assert quantized_layers(model) > 0
    plain, _ = mlx_lm.load(str(model_path("qwen3")))
    assert float32_weights(plain, limit_bytes=1 << 30) == "already float32"



@pytest.mark.skipif(backend().kind != "cpu", reason="applies where MLX runs on the CPU")
def test_a_quantized_model_is_served_in_float32(quantized_dir, tmp_path, monkeypatch):
    """Converted when set to (``=1``, unmeasured), not when turned off; the disk tier keeps
    the two kinds of snapshots apart."""
    tiers = []
    for setting, converted in (("1", True), ("0", False)):
        monkeypatch.setenv("MLX_GATEWAY_CPU_FLOAT32", setting)
        with live_server(quantized_dir, prompt_cache_dir=str(tmp_path / "disk")) as server, server.client() as c:
            assert (quantized_layers(server.engine.model) == 0) is converted
            r = c.post("/v1/completions", json={"model": "test-model", "prompt": "the sea", "max_tokens": 4})
            assert r.status_code == 200, r.text
            tiers.append(server.engine.prompt_cache.disk.tier.dir)
    assert tiers[0] != tiers[1]


@pytest.mark.parametrize("seconds,want", [
    # quantized matmuls in MLX's own CPU loops: float32 wins both ways
    ({"stored prefill": 0.0616, "float32 prefill": 0.00016, "stored decode": 0.00188, "float32 decode": 0.00006},
     True),
    # a machine whose quantized kernels are fast: float32 reads 8x the bytes per decode step
    ({"stored prefill": 0.0010, "float32 prefill": 0.0009, "stored decode": 0.00005, "float32 decode": 0.0004},
     False),
    # prefill faster in float32 but decode slower: the request's mix decides
    ({"stored prefill": 0.0100, "float32 prefill": 0.0010, "stored decode": 0.0001, "float32 decode": 0.0002},
     True),
])
def test_the_conversion_follows_the_measurement(seconds, want):
    assert decide(seconds) is want


@pytest.mark.skipif(backend().kind != "cpu", reason="applies where MLX runs on the CPU")
@pytest.mark.parametrize("faster", ["float32", "as stored"])
def test_the_model_is_converted_only_where_float32_measured_faster(quantized, monkeypatch, faster, caplog):
    import logging

    from gateway.cpu import weights

    model, _ = quantized
    fast, slow = 0.001, 0.01
    timings = {f"{kind} {shape}": (fast if (kind == "float32") == (faster == "float32") else slow)
               for kind in ("stored", "float32") for shape in ("prefill", "decode")}
    monkeypatch.delenv("MLX_GATEWAY_CPU_FLOAT32", raising=False)
    monkeypatch.setattr(weights, "measure_layer", lambda layer, rounds=3: timings)
    with caplog.at_level(logging.INFO, logger="mlx_gateway"):
        why = weights.float32_weights_for_cpu_backend(model)
    assert (why is None) == (faster == "float32")
    assert (quantized_layers(model) == 0) == (faster == "float32")
    assert f"weights (as stored, or float32): {faster} (measured: stored prefill" in caplog.text


def test_the_layer_timings_cover_both_shapes(quantized):
    from gateway.cpu import weights

    model, _ = quantized
    layer = weights._sample_layer(model)
    assert isinstance(layer, nn.QuantizedLinear)
    seconds = weights.measure_layer(layer, rounds=1, rows=16)
    assert set(seconds) == {"stored prefill", "float32 prefill", "stored decode", "float32 decode"}
    assert all(s > 0 for s in seconds.values())
    stored, w32, _ = weights._stored_matmul(layer, 16)
    x = mx.random.normal((3, layer.weight.shape[1] * 32 // layer.bits))
    assert float(mx.max(mx.abs(stored(x) - x @ w32.T))) < 1e-3  # the same matmul, dequantized
