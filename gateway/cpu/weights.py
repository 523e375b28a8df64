"""float32 weights where MLX runs on the CPU.

MLX's CPU backend sends float32 matmuls to BLAS (OpenBLAS, see :mod:`gateway.cpu.blas`),
but runs quantized, float16 and bfloat16 matmuls in its own loops. On the default model
(SmolLM2-135M-Instruct, 4-bit Q4_1 from GGUF) a 287-token prefill took 39.8 s and a
decode step 168 ms on a 2-core Linux machine; with float32 weights (538 MB instead of
98), 1.04 s and 87 ms (``benchmarks/bench_cpu_weights.py``, quoted in the README).

:func:`float32_weights` dequantizes a model's quantized layers (mlx-lm's
``dequantize_model``) and casts every floating-point parameter to float32, when the
float32 weights fit in :data:`MEMORY_SHARE` of the memory this process may use (physical
memory, or a container's cgroup limit if lower); a 7B 4-bit model would need 28 GB and
stays as it is, with a warning (the CPU tuning applies it as a model is read,
:meth:`gateway.backend.CpuTuning.prepare_weights`; ``MLX_GATEWAY_CPU_FLOAT32=0`` keeps the
weights as stored).

Dequantizing is exact. A model whose activations were float32 already (the default one:
its norms are float32) gives the same outputs up to float32 rounding; a float16 or
bfloat16 model now computes in float32, more precisely, and its KV cache and prompt-cache
snapshots take twice the bytes (``--prompt-cache-bytes`` holds half as many tokens).

Models are left as stored when a layer is quantized in a way ``dequantize_model`` does
not handle: subclasses of MLX's quantized layers (afm7's fused QKV), other quantized
layer types (``QuantizedMultiLinear``, ``HadamardQuantizedLinear``, ``BitLinear``), and
experts with an nvfp4 global scale.

Whether float32 is faster is measured at load, on one of the model's own layers
(:func:`measure_layer`): its matmul as stored and as float32, for a prefill chunk of
:data:`CHUNK` tokens and for one decode token; the weights are converted when a request of
:data:`REQUEST` (prompt, generated) tokens costs less that way by
:data:`gateway.cpu.measure.MARGIN` (:func:`decide`), and the log gives the figures.
``MLX_GATEWAY_CPU_FLOAT32=1`` converts without measuring.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from gateway.cpu.allocator import Allocator
from gateway.cpu.measure import Choice, MARGIN, race

log = logging.getLogger("mlx_gateway")

MEMORY_SHARE = 0.25  # float32 weights may take at most this share of memory_limit_bytes()
FLOATS = (mx.float16, mx.bfloat16, mx.float32)
CHUNK = 32  # tokens of the prefill-shaped timing
SAMPLE_ROWS = 128  # output rows of the sampled layer that are timed
REQUEST = (1000, 200)  # (prompt, generated) tokens of the request the two timings are weighed by


def memory_limit_bytes() -> Optional[int]:
    """Memory this process may use (bytes): physical memory (``sysconf``), or the cgroup's
    limit when a container sets a lower one (``memory.max``, v1 ``memory.limit_in_bytes``);
    None where neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            limits.append(int(raw))
    return min(limits) if limits else None


def _kinds() -> tuple[type, ...]:
    """The quantized layer types ``dequantize_model`` replaces: linear, embedding and
    (mlx-lm's) mixture-of-experts."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear


def _quantized_layers(model: nn.Module) -> list[nn.Module]:
    """Layers of exactly the :func:`_kinds` types."""
    kinds = _kinds()
    return [m for _, m in model.named_modules() if type(m) in kinds]


def _unsupported(model: nn.Module) -> list[str]:
    """Names of layer types that are quantized in a way :func:`float32_weights` does not
    convert: subclasses of the quantized types (``dequantize_model`` would replace them
    with a plain layer), other quantized layers, and experts with a global scale."""
    known = _kinds()
    out = set()
    for _, m in model.named_modules():
        name = type(m).__name__
        if type(m) in known:
            if m.get("global_scale") is not None:
                out.add(f"{name} with a global scale")
        elif isinstance(m, known) or "Quantized" in name or name == "BitLinear":
            out.add(name)
    return sorted(out)


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


def _why_not(model: nn.Module, limit_bytes: Optional[int] = None) -> Optional[str]:
    """Why :func:`float32_weights` would leave ``model`` as stored, or None if it converts it."""
    unsupported = _unsupported(model)
    if unsupported:
        return f"unsupported quantized layers: {', '.join(unsupported)}"
    low = [p for p in _plain_parameters(model) if p.dtype in (mx.float16, mx.bfloat16)]
    if not _quantized_layers(model) and not low:
        return "already float32"
    need = float32_bytes(model)
    if limit_bytes is None:
        memory = memory_limit_bytes()
        if memory is None:
            return "too large to tell: the memory available cannot be read"
        limit_bytes = int(MEMORY_SHARE * memory)
    if need > limit_bytes:
        return f"too large: {need / 1e9:.1f} GB as float32, more than {limit_bytes / 1e9:.1f} GB"
    return None


def float32_weights(model: nn.Module, limit_bytes: Optional[int] = None) -> Optional[str]:
    """Dequantize ``model``'s quantized layers and cast its floating-point parameters to
    float32, in place, unless that is not needed, a layer is of a type it does not convert,
    or it would take more than ``limit_bytes`` (default: :data:`MEMORY_SHARE` of
    :func:`memory_limit_bytes`).

    Returns:
        None when the weights were converted; otherwise why not ("already float32",
        "too large: ...", "unsupported quantized layers: ..."), the model unchanged.
    """
    from mlx_lm.utils import dequantize_model

    why = _why_not(model, limit_bytes)
    if why is not None:
        return why
    need, quantized = float32_bytes(model), len(_quantized_layers(model))
    dequantize_model(model)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in FLOATS else p, model.parameters()))
    mx.eval(model.parameters())
    log.info("MLX runs on the CPU: weights converted to float32 (%d quantized layers dequantized, %.0f MB), "
             "since its CPU matmuls use BLAS for float32 only; MLX_GATEWAY_CPU_FLOAT32=0 keeps them as stored",
             quantized, need / 1e6)
    return None


def served_bytes(model: nn.Module) -> int:
    """Bytes ``model``'s parameters will take once served: as float32 where
    :func:`float32_weights_for_cpu_backend` will convert them, else as stored. Read from
    the shapes and dtypes only, so a lazily loaded model's weights are not read."""
    if os.environ.get("MLX_GATEWAY_CPU_FLOAT32", "1") != "0" and _why_not(model) is None:
        return float32_bytes(model)
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def _sample_layer(model: nn.Module) -> Optional[nn.Module]:
    """The largest quantized or half-precision linear layer (a matmul the model runs per
    token), or None."""
    best, size = None, -1
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear or (type(m) is nn.Linear and m.weight.dtype in (mx.float16, mx.bfloat16)):
            n = math.prod(m.weight.shape)
            if n > size:
                best, size = m, n
    return best


def _stored_matmul(layer: nn.Module, rows: int) -> tuple[Callable[[mx.array], mx.array], mx.array, mx.Dtype]:
    """``(x -> x @ W[:rows].T as stored, W[:rows] as float32, the input dtype)`` for a
    quantized or half-precision linear ``layer`` (``W`` is ``[out, in]``)."""
    if isinstance(layer, nn.QuantizedLinear):
        mode = getattr(layer, "mode", "affine")
        w, scales, biases = (None if a is None else a[:rows] for a in
                             (layer.weight, layer.scales, layer.get("biases")))
        kwargs = dict(transpose=True, group_size=layer.group_size, bits=layer.bits, mode=mode)
        f32 = mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=mode)
        return (lambda x: mx.quantized_matmul(x, w, scales, biases, **kwargs)), f32.astype(mx.float32), scales.dtype
    w = layer.weight[:rows]
    return (lambda x: x @ w.T), w.astype(mx.float32), w.dtype


def measure_layer(layer: nn.Module, rounds: int = 3, rows: int = SAMPLE_ROWS) -> dict[str, float]:
    """Seconds (fastest of ``rounds``) of ``rows`` output rows of ``layer``'s matmul as
    stored and as float32 (the cost of a matmul goes by its rows, so the ratio is the
    layer's), on a prefill chunk of :data:`CHUNK` tokens and on one token: keys ``stored
    prefill``, ``float32 prefill``, ``stored decode``, ``float32 decode``."""
    stored, w32, dtype = _stored_matmul(layer, rows)
    n_in = w32.shape[1]
    x = {"prefill": mx.random.normal((1, CHUNK, n_in), key=mx.random.key(0)),
         "decode": mx.random.normal((1, 1, n_in), key=mx.random.key(1))}
    mx.eval(w32, x)
    calls = {}
    for shape, a in x.items():
        low = a.astype(dtype)
        mx.eval(low)
        calls[f"stored {shape}"] = lambda low=low: stored(low)
        calls[f"float32 {shape}"] = lambda a=a: a @ w32.T
    return race(calls, rounds, budget=0.2, sync=mx.eval)


def decide(seconds: dict[str, float], margin: float = MARGIN) -> bool:
    """Convert to float32: a request of :data:`REQUEST` tokens costs less by ``margin``
    with float32 matmuls than as stored, from :func:`measure_layer`'s timings."""
    prompt, generated = REQUEST

    def cost(kind: str) -> float:
        return prompt / CHUNK * seconds[f"{kind} prefill"] + generated * seconds[f"{kind} decode"]

    return cost("float32") < cost("stored") * (1.0 - margin)


def float32_weights_for_cpu_backend(model: nn.Module, allocator: Optional[Allocator] = None, rounds: int = 3,
                                    measure: bool = True, decided: Optional[str] = None) -> Optional[str]:
    """:func:`float32_weights` (MLX runs on the CPU) when a measurement on one of the
    model's layers finds float32 faster (:func:`measure_layer`, :func:`decide`; timed with
    ``allocator``'s heap as it will serve), unless ``MLX_GATEWAY_CPU_FLOAT32=0`` (``=1`` or
    ``measure`` false: without measuring, as the ranks of a model split across machines
    must all decide alike; ``decided``, ``"float32"`` or ``"as stored"``: as an earlier
    load of the same files found, without measuring);
    logs the choice, and a warning when a model that is not float32 stays as stored
    because it is too large or has layers it cannot convert. Returns why it did not
    convert, or None."""
    setting = os.environ.get("MLX_GATEWAY_CPU_FLOAT32", "")
    if setting == "0":
        return "MLX_GATEWAY_CPU_FLOAT32=0"
    why = _why_not(model)
    if why is not None:
        if why != "already float32":
            log.warning("MLX runs on the CPU, where quantized, float16 and bfloat16 matmuls are many times "
                        "slower than float32 ones; the weights stay as stored (%s)", why)
        return why
    layer = _sample_layer(model)
    what = "weights (as stored, or float32)"
    if decided == "as stored":
        return "measured faster as stored at an earlier load"
    if measure and decided is None and setting != "1" and layer is not None:
        if allocator is not None:
            allocator.as_it_will_serve()  # timed with the heap as it will serve
        mx.eval(layer.parameters())
        seconds = measure_layer(layer, rounds)
        if not decide(seconds):
            Choice(what, "as stored", seconds).log()
            return "measured faster as stored"
        Choice(what, "float32", seconds).log()
    try:
        why = float32_weights(model)
    except Exception as e:  # dequantize_model swaps the layers in one update: nothing half done
        log.exception("converting the weights to float32 failed; they stay as stored")
        return f"failed: {e}"
    return why
