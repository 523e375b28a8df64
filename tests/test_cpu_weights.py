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

from conftest import live_server, model_path
from gateway.cpu import cpu_backend
from gateway.cpu.weights import float32_bytes, float32_weights

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


def test_left_alone_when_too_large_or_already_float32(quantized):
    model, full = quantized
    assert float32_weights(model, limit_bytes=full - 1).startswith("too large")
    assert quantized_layers(model) > 0
    plain, _ = mlx_lm.load(str(model_path("qwen3")))
    assert float32_weights(plain, limit_bytes=1 << 30) == "already float32"


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "qwen3-q4"
    mlx_lm.convert(str(model_path("qwen3")), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    return out


@pytest.mark.skipif(not cpu_backend(), reason="applies where MLX runs on the CPU")
@pytest.mark.parametrize("setting,converted", [(None, True), ("0", False)])
def test_a_quantized_model_is_served_in_float32(quantized_dir, monkeypatch, setting, converted):
    if setting is None:
        monkeypatch.delenv("MLX_GATEWAY_CPU_FLOAT32", raising=False)
    else:
        monkeypatch.setenv("MLX_GATEWAY_CPU_FLOAT32", setting)
    with live_server(quantized_dir) as server, server.client() as c:
        assert (quantized_layers(server.engine.model) == 0) is converted
        r = c.post("/v1/completions", json={"model": "test-model", "prompt": "the sea", "max_tokens": 4})
        assert r.status_code == 200, r.text
