"""The CPU backend's attention (gateway/cpu/attention.py) against MLX's own, alone and in
the batched serving path, and the allocator setting that keeps freed memory for reuse."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from conftest import assert_same_tokens, load_model, model_path, prefilled
from gateway.backend import backend
from gateway.cpu import attention, attention_kernels
from scheduler.batch.generator import JoiningBatchGenerator
from test_generator import run

plans = attention.Plans()  # the kernels these tests plan, apart from any server's


def test_exp_matches_mlx_exp():
    x = mx.concatenate([-mx.random.uniform(0, 87, (50_000,), key=mx.random.key(0)), mx.array([0.0, -1e-9])])
    rel = mx.abs(attention_kernels.exp_nonpositive(x) - mx.exp(x)) / mx.exp(x)
    assert float(mx.max(rel)) < 1e-6
    tiny = attention_kernels.exp_nonpositive(mx.array([-90.0, -1000.0, -float("inf")]))
    assert float(mx.max(tiny)) < 2e-38  # clamped at 2**-126 where exp underflows to 0


def qkv(b, hq, hk, tq, tk, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 3)
    return [mx.random.normal(s, key=k).astype(dtype)
            for s, k in zip(((b, hq, tq, 16), (b, hk, tk, 16), (b, hk, tk, 16)), keys)]


def make_mask(kind, b, hq, tq, tk, dtype):
    key = mx.random.key(7)
    return {
        None: None,
        "causal": "causal",
        "bool": mx.random.uniform(shape=(b, 1, tq, tk), key=key) > 0.3,
        "bool per head": mx.random.uniform(shape=(b, hq, tq, tk), key=key) > 0.3,
        "bool 2-d": mx.random.uniform(shape=(tq, tk), key=key) > 0.3,
        "additive": mx.random.normal((b, 1, tq, tk), key=key).astype(dtype),
    }[kind]


def rows_that_see_a_key(mask, b, hq, tq, tk):
    """``[b, hq, tq]`` True where the query has at least one key to attend to (a fully
    masked row is padding: any output is right for it)."""
    if mask is None or isinstance(mask, str) or mask.dtype != mx.bool_:
        return mx.ones((b, hq, tq), dtype=mx.bool_)
    return mx.broadcast_to(mx.any(mask, axis=-1), (b, hq, tq))


def padded_causal(b, tq, tk):
    from mlx_lm.models.base import create_causal_mask

    return create_causal_mask(tq, tk - tq, left_padding=mx.array([0, 5][:b]))


@pytest.mark.parametrize("kernel", sorted(attention.KERNELS))
@pytest.mark.parametrize("mask", [None, "causal", "bool", "bool per head", "bool 2-d", "additive", "padded causal"])
@pytest.mark.parametrize("heads,tq,tk", [((8, 4), 5, 9), ((4, 4), 1, 12), ((6, 2), 7, 7), ((2, 1), 3, 40),
                                         ((9, 3), 70, 70), ((4, 2), 150, 171)])
def test_every_kernel_matches_mlx_attention(kernel, mask, heads, tq, tk):
    q, k, v = qkv(2, heads[0], heads[1], tq, tk, mx.float32, seed=tq * tk)
    m = padded_causal(2, tq, tk) if mask == "padded causal" else make_mask(mask, 2, heads[0], tq, tk, mx.float32)
    want = attention_kernels.mlx_attention(q, k, v, scale=0.3, mask=m)
    got = attention.KERNELS[kernel](q, k, v, 0.3, m)
    assert got.shape == want.shape and got.dtype == want.dtype
    seen = rows_that_see_a_key(m, 2, heads[0], tq, tk)[..., None]
    assert float(mx.max(mx.where(seen, mx.abs(got - want), 0.0))) < 1e-5


def test_only_keys_a_block_can_see_are_read_under_a_causal_mask():
    """A causal or padded-causal mask lets each block stop at its last query's key; a mask
    that shows a later key does not (the block then reads every key)."""
    tq, tk = 4, 10
    assert attention_kernels.hides_future("causal", tq, tk)
    assert attention_kernels.hides_future(padded_causal(2, tq, tk), tq, tk)
    assert not attention_kernels.hides_future(None, tq, tk)
    shows_later = mx.ones((tq, tk), dtype=mx.bool_)
    assert not attention_kernels.hides_future(shows_later, tq, tk)
    assert not attention_kernels.hides_future(mx.zeros((tq, tk)), tq, tk)  # additive: not checked, not assumed
    blocks = list(attention_kernels.blocks(70, 100, 32, causal=True))
    assert blocks == [(0, 32, 62), (32, 64, 94), (64, 70, 100)]
    assert [n for *_, n in attention_kernels.blocks(70, 100, 32, causal=False)] == [100, 100, 100]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_and_mixed_dtypes_go_to_mlx(dtype):
    q, k, v = qkv(1, 4, 2, 3, 6, mx.float32, seed=2)
    with plans.installed("compiled-blocks", "compiled-blocks", [(4, 2, 16, mx.float32), (4, 2, 16, dtype)]):
        q16 = q.astype(dtype)
        assert mx.array_equal(plans.attention(q16, k, v, scale=0.3, mask="causal"),
                              attention_kernels.mlx_attention(q16, k, v, scale=0.3, mask="causal"))
        q16, k16, v16 = (a.astype(dtype) for a in (q, k, v))
        assert mx.array_equal(plans.attention(q16, k16, v16, scale=0.3, mask="causal"),
                              attention_kernels.mlx_attention(q16, k16, v16, scale=0.3, mask="causal"))


def test_sinks_go_to_mlx_and_bad_mask_mode_is_refused():
    q, k, v = qkv(1, 4, 2, 3, 6, mx.float32, seed=1)
    sinks = mx.array([0.5, -1.0, 0.0, 2.0])
    with plans.installed("compiled-blocks", "compiled-blocks", [(4, 2, 16, mx.float32)]):
        want = attention_kernels.mlx_attention(q, k, v, scale=0.3, mask="causal", sinks=sinks)
        got = plans.attention(q, k, v, scale=0.3, mask="causal", sinks=sinks)
        assert mx.array_equal(got, want)
        with pytest.raises(ValueError, match="mask_mode"):
            plans.attention(q, k, v, scale=0.3, mask="sideways")


def test_installed_replaces_mx_fast_attention_and_restores_it():
    original = mx.fast.scaled_dot_product_attention
    with plans.installed():
        assert mx.fast.scaled_dot_product_attention == plans.attention
    assert mx.fast.scaled_dot_product_attention is original


def test_the_planned_kernel_runs_for_its_shape_and_regime(monkeypatch):
    """Prefill calls (more than FEW_QUERIES queries a row) go to the prefill kernel planned
    for their shape and their rows x keys' bucket, decode calls (one query) to the decode
    one of their context's bucket, verify calls (2 to FEW_QUERIES) to the verify one of
    theirs; an unplanned shape runs MLX's own."""
    calls = []
    for name in attention.KERNELS:
        monkeypatch.setitem(attention.KERNELS, name, lambda q, k, v, s, m, name=name: calls.append(name) or q)
    q, k, v = qkv(1, 4, 2, attention.FEW_QUERIES + 1, 40, mx.float32, seed=3)
    (_, short), (medium, _), (longer, _), (long, _) = attention.DECODE_BUCKETS
    decode = ("mlx", "compiled-decode", "compiled-blocks", "compiled-decode")
    (_, *_), (wide, *_) = attention.PREFILL_BUCKETS
    verify = ("compiled-decode", "compiled-blocks-16", "compiled-blocks-8", "mlx")
    with plans.installed(("compiled-blocks", "compiled-blocks-8"), decode, [(4, 2, 16, mx.float32)], verify):
        plans.attention(q, k, v, scale=0.3, mask="causal")
        for rows, keys in ((1, wide - 1), (1, wide), (2, wide // 2 - 1), (2, wide // 2)):  # rows x keys' edges
            kv = mx.zeros((rows, 2, keys, 16))
            plans.attention(mx.concatenate([q] * rows), kv, kv, scale=0.3, mask="causal")
        plans.attention(q[:, :, :1], k, v, scale=0.3)
        plans.attention(q[:, :, :5], k, v, scale=0.3, mask="causal")  # verifying four drafts
        for keys in (medium - 1, medium, longer - 1, longer, long - 1, long, 2 * long):  # the buckets' edges
            kv = mx.zeros((1, 2, keys, 16))
            plans.attention(q[:, :, :1], kv, kv, scale=0.3)
            plans.attention(q[:, :, :2], kv, kv, scale=0.3, mask="causal")  # a verify step's
        plans.attention(q[:, :, :attention.FEW_QUERIES], k, v, scale=0.3, mask="causal")  # the most a verify has
        other = plans.attention(*qkv(1, 6, 2, 3, 6, mx.float32, seed=3), scale=0.3)  # not planned
    assert calls == ["compiled-blocks", "compiled-blocks", "compiled-blocks-8", "compiled-blocks", "compiled-blocks-8",
                     "mlx", "compiled-decode",
                     "mlx", "compiled-decode", "compiled-decode", "compiled-blocks-16",
                     "compiled-decode", "compiled-blocks-16", "compiled-blocks", "compiled-blocks-8",
                     "compiled-blocks", "compiled-blocks-8", "compiled-decode", "mlx",
                     "compiled-decode", "mlx", "compiled-decode"]
    assert other.shape == (1, 6, 3, 16)


WIDE = {"mlx": 0.090, "compiled-blocks": 0.030, "compiled-blocks-16": 0.024, "compiled-blocks-8": 0.021}


@pytest.mark.parametrize("prefills,decodes,want", [
    ([{"mlx": 0.040, "compiled-blocks": 0.020}, WIDE],
     [{"mlx": 0.0005, "compiled-decode": 0.0009}, {"mlx": 0.0010, "compiled-decode": 0.0015},
      {"mlx": 0.0030, "compiled-decode": 0.0015}, {"mlx": 0.0072, "compiled-decode": 0.0036},  # then the verify steps'
      {"mlx": 0.0008, "compiled-decode": 0.0010}, {"mlx": 0.0020, "compiled-decode": 0.0010},
      {"mlx": 0.0060, "compiled-decode": 0.0030}, {"mlx": 0.0090, "compiled-decode": 0.0095}],
     ("compiled-blocks", "compiled-blocks-8", "mlx", "mlx", "compiled-decode", "compiled-decode",
      "mlx", "compiled-decode", "compiled-decode", "mlx")),
    ([{"mlx": 0.020, "compiled-blocks": 0.080}, {**WIDE, "mlx": 0.022}],  # within the margin
     [{"mlx": 0.0010, "compiled-decode": 0.00098}, {"mlx": 0.0020, "compiled-decode": 0.0010},
      {"mlx": 0.0030, "compiled-decode": 0.0029}, {"mlx": 0.0070, "compiled-decode": 0.0069},
      {"mlx": 0.0010, "compiled-decode": 0.00098}, {"mlx": 0.0020, "compiled-decode": 0.0019},
      {"mlx": 0.0030, "compiled-decode": 0.0029}, {"mlx": 0.0070, "compiled-decode": 0.0069}],
     ("mlx", "mlx", "mlx", "compiled-decode", "mlx", "mlx", "mlx", "mlx", "mlx", "mlx")),
    ([{"mlx": 0.020}, {"mlx": 0.090}], [{"mlx": 0.0005}, {"mlx": 0.0010}, {"mlx": 0.0030}, {"mlx": 0.0070}] * 2,
     ("mlx",) * 10),  # no g++: MLX's own only
])
def test_the_choice_follows_the_measurement(prefills, decodes, want):
    with plans.installed():
        choices = plans.choose(9, 3, 64, mx.float32, *prefills, *decodes)
        assert plans.planned(9, 3, 64, mx.float32) == want
        with pytest.raises(ValueError, match="buckets"):
            plans.choose(9, 3, 64, mx.float32, *prefills, *decodes[:2])
    assert [c.chosen for c in choices] == list(want)
    assert all(f"{1e3 * s:.2f} ms" in c.describe() for c, figures in zip(choices, (*prefills, *decodes))
               for s in figures.values())
    assert plans.planned(9, 3, 64, mx.float32) is None  # installed() put the plans back


def test_attention_shapes_are_traced_from_the_model():
    model = load_model(model_path("qwen3"))
    args = model.args
    assert attention.attention_shapes(model) == {
        (args.num_attention_heads, args.num_key_value_heads, args.head_dim, mx.float32)}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("kernels", [("compiled-blocks", "compiled-decode"), ("compiled-blocks", "mlx"),
                                     (("compiled-blocks", "compiled-blocks-8"), "compiled-decode")])
def test_serving_generator_with_it_matches_mlx_lm_with_mlx_attention(arch, kernels, monkeypatch):
    """The batched, joining generator on these kernels gives mlx-lm's generator's tokens
    (logprobs within 1e-4) on MLX's attention: cold rows of different lengths (left
    padding, array masks), warm rows, a sliding window (gemma3_text) and hybrids. With two
    prefill kernels, the wide bucket starts at 32 rows x keys, so that these small batches
    reach it."""
    monkeypatch.setattr(attention_kernels, "COMPILED_BLOCK", 8)
    if not isinstance(kernels[0], str):
        (_, *narrow), (_, *wide) = attention.PREFILL_BUCKETS
        monkeypatch.setattr(attention, "PREFILL_BUCKETS", ((0, *narrow), (32, *wide)))
    model = load_model(model_path(arch))
    base = [(11 * i + 5) % 200 + 10 for i in range(48)]
    warm = prefilled(model, base[:40])
    rows = [
        ([base[:20], base[20:37], base[37:40]], None, [], 6),
        ([[base[40]]], warm, base[:40], 6),
        ([[t + 1 for t in base[:27]]], None, [], 5),
        ([base[40:45], [base[45]]], warm, base[:40], 4),
    ]
    want = run(BatchGenerator, model, rows, prefill_batch=4, decode_batch=4)
    with plans.installed(*kernels, attention.attention_shapes(model)):
        warm = prefilled(model, base[:40])
        rows[1], rows[3] = (rows[1][0], warm, *rows[1][2:]), (rows[3][0], warm, *rows[3][2:])
        got = run(JoiningBatchGenerator, model, rows, prefill_batch=4, decode_batch=4)
    assert got[1] == want[1]
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        assert_same_tokens(g, w, f"{arch} row {i}")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


FREED_STAYS = """
import ctypes, sys
sys.path.insert(0, {root!r})
from gateway.cpu.allocator import Allocator
from test_cpu_attention import MallInfo2
print(Allocator().keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
p = libc.malloc(64 << 20)
ctypes.memset(p, 1, 64 << 20)
libc.free(p)
print(libc.mallinfo2().fordblks >= 64 << 20)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(),
                    reason="glibc's malloc (2.33 or later, for mallinfo2)")
@pytest.mark.skipif(backend().kind != "cpu", reason="the setting applies where MLX runs on the CPU")
@pytest.mark.parametrize("setting,want", [(None, ["None", "True"]), ("0", ["MLX_GATEWAY_MALLOC_TUNE=0", "False"])])
def test_freed_memory_stays_for_reuse(setting, want):
    """With the setting, 64 MiB freed stays in the heap as free bytes (glibc's default
    gives a block that large its own mmap and unmaps it on free)."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_MALLOC_TUNE"}
    if setting is not None:
        env["MLX_GATEWAY_MALLOC_TUNE"] = setting
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here])
    out = subprocess.run([sys.executable, "-c", FREED_STAYS.format(root=os.path.dirname(here))], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert out == want


def test_models_kernels_are_measured_and_planned_unless_turned_off(monkeypatch):
    model = load_model(model_path("qwen3"))
    (shape,) = attention.attention_shapes(model)
    plans = attention.Plans()  # none planned yet
    monkeypatch.setenv("MLX_GATEWAY_CPU_ATTENTION", "0")
    try:
        (choice,) = plans.choose_for_model(model, rounds=1)
        assert choice.chosen == "mlx" and choice.reason == "MLX_GATEWAY_CPU_ATTENTION=0"
        assert plans.planned(*shape) is None
        monkeypatch.delenv("MLX_GATEWAY_CPU_ATTENTION")
        choices = plans.choose_for_model(model, rounds=1)
        (_, short), (medium, _), (longer, _), (long, _) = attention.DECODE_BUCKETS
        (_, *_), (wide, *_) = attention.PREFILL_BUCKETS
        assert [c.what.split(" [")[0] for c in choices] == [
            f"attention, prefill over 0-{wide - 1} rows x keys", f"attention, prefill over {wide}+ rows x keys",
            *(f"attention, {step} over {a}-{b - 1} keys" if b else f"attention, {step} over {a}+ keys"
              for step in ("decode", "verify") for a, b in ((0, medium), (medium, longer), (longer, long), (long, None)))]
        assert plans.planned(*shape) == tuple(c.chosen for c in choices)
        compiled = set() if shutil.which("g++") else {k for k in attention.KERNELS if k.startswith("compiled-")}
        assert set(choices[0].seconds) == set(attention.PREFILL_KERNELS) - compiled
        assert set(choices[1].seconds) == set(attention.WIDE_PREFILL_KERNELS) - compiled
        assert all(set(c.seconds) == set(attention.DECODE_KERNELS) - compiled for c in choices[2:])
        assert mx.fast.scaled_dot_product_attention == plans.attention
    finally:
        attention.uninstall()
