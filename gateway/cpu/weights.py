"""float32 weights where MLX runs on the CPU.

MLX's CPU backend sends float32 matmuls to BLAS (OpenBLAS, see :mod:`gateway.cpu.blas`),
but runs quantized, float16 and bfloat16 matmuls in its own scalar loops. The default
model (SmolLM2-135M-Instruct, 4-bit Q4_1 from GGUF) then prefilled 287 tokens in 42 s
with a 203 ms decode step on this project's 2-core Linux machine; dequantized to
float16, 36 s and 730 ms; to float32 (538 MB instead of about 100), 1.5 s and 120 ms.

:func:`float32_weights` dequantizes a model's quantized layers (mlx-lm's
``dequantize_model``) and casts every floating-point parameter to float32, when the
float32 weights fit in :data:`MEMORY_SHARE` of physical memory (a 7B 4-bit model would
need 28 GB: it stays as it is, with a warning). ``mlx-gateway serve`` applies it on the
CPU backend right after loading; ``MLX_GATEWAY_CPU_FLOAT32=0`` keeps the weights as
stored. On Metal (macOS) none of this applies: quantized matmuls are fast there.
Dequantizing is exact, so outputs change only by float32 rounding (and become more
precise than float16 activations).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

log = logging.getLogger("mlx_gateway")

MEMORY_SHARE = 0.25  # float32 weights may take at most this share of physical memory
FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def physical_memory_bytes() -> Optional[int]:
    """Physical memory in bytes (``sysconf``); None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _quantized_layers(model: nn.Module) -> list[nn.Module]:
    """Quantized linear, embedding and (mlx-lm's) mixture-of-experts layers."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def _plain_parameters(model: nn.Module) -> list[mx.array]:
    """Parameters that are not part of a quantized layer."""
    skip = {id(p) for m in _quantized_layers(model) for _, p in tree_flatten(m.parameters())}
    return [p for _, p in tree_flatten(model.parameters()) if id(p) not in skip]


def float32_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters would take as float32: quantized weights dequantized
    (``bits`` per element, packed in uint32), other floating-point parameters cast,
    integer ones as they are."""
    total = 0
    for m in _quantized_layers(model):
        total += 4 * math.prod(m.weight.shape[:-1]) * m.weight.shape[-1] * 32 // m.bits
        if "bias" in m:
            total += 4 * m.bias.size
    return total + sum(4 * p.size if p.dtype in FLOATS else p.nbytes for p in _plain_parameters(model))


def float32_weights(model: nn.Module, limit_bytes: Optional[int] = None) -> Optional[str]:
    """Dequantize ``model``'s quantized layers and cast its floating-point parameters to
    float32, in place, unless that is not needed or would take more than ``limit_bytes``
    (default: :data:`MEMORY_SHARE` of physical memory).

    Returns:
        None when the weights were converted; otherwise why not ("already float32",
        "too large: ..."). Never raises for a model it leaves alone.
    """
    from mlx_lm.utils import dequantize_model

    quantized = _quantized_layers(model)
    low = [p for p in _plain_parameters(model) if p.dtype in (mx.float16, mx.bfloat16)]
    if not quantized and not low:
        return "already float32"
    need = float32_bytes(model)
    if limit_bytes is None:
        physical = physical_memory_bytes()
        limit_bytes = int(MEMORY_SHARE * physical) if physical else 0
    if need > limit_bytes:
        return f"too large: {need / 1e9:.1f} GB as float32, more than {limit_bytes / 1e9:.1f} GB"
    dequantize_model(model)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in FLOATS else p, model.parameters()))
    mx.eval(model.parameters())
    log.info("MLX runs on the CPU: weights converted to float32 (%d quantized layers dequantized, %.0f MB), "
             "since its CPU matmuls use BLAS for float32 only; MLX_GATEWAY_CPU_FLOAT32=0 keeps them as stored",
             len(quantized), need / 1e6)
    return None


def float32_weights_for_cpu_backend(model: nn.Module) -> Optional[str]:
    """:func:`float32_weights` when MLX runs on the CPU, unless
    ``MLX_GATEWAY_CPU_FLOAT32=0``; logs a warning when the model is too large. Returns
    why it did not convert, or None."""
    from gateway.cpu import cpu_backend

    if os.environ.get("MLX_GATEWAY_CPU_FLOAT32", "1") == "0":
        return "MLX_GATEWAY_CPU_FLOAT32=0"
    if not cpu_backend():
        return "MLX runs on a GPU"
    why = float32_weights(model)
    if why is not None and why.startswith("too large"):
        log.warning("MLX runs on the CPU, where quantized, float16 and bfloat16 matmuls are many times "
                    "slower than float32 ones; the weights stay as stored (%s)", why)
    return why
