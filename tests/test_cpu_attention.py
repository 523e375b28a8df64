"""The CPU backend's attention (gateway/cpu/attention.py) against MLX's own, alone and in
the batched serving path, and the allocator setting that keeps freed memory for reuse."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator

from conftest import assert_same_tokens, model_path, prefilled
from gateway.cpu import attention, cpu_backend
from scheduler.generator import JoiningBatchGenerator
from test_generator import run


def test_exp_matches_mlx_exp():
    x = mx.concatenate([-mx.random.uniform(0, 87, (50_000,), key=mx.random.key(0)), mx.array([0.0, -1e-9])])
    rel = mx.abs(attention.exp_nonpositive(x) - mx.exp(x)) / mx.exp(x)
    assert float(mx.max(rel)) < 1e-6
    tiny = attention.exp_nonpositive(mx.array([-90.0, -1000.0, -float("inf")]))
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


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.float16, 2e-3), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "bool per head", "bool 2-d", "additive"])
@pytest.mark.parametrize("heads,tq,tk", [((8, 4), 5, 9), ((4, 4), 1, 12), ((6, 2), 7, 7), ((2, 1), 3, 40)])
def test_matches_mlx_attention(dtype, tol, mask, heads, tq, tk):
    q, k, v = qkv(2, heads[0], heads[1], tq, tk, dtype, seed=tq * tk)
    m = make_mask(mask, 2, heads[0], tq, tk, dtype)
    want = attention._mlx_attention(q, k, v, scale=0.3, mask=m)
    got = attention.attention(q, k, v, scale=0.3, mask=m)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)))) < tol


def test_other_dtypes_go_to_mlx():
    q, k, v = qkv(1, 4, 2, 3, 6, mx.float32, seed=2)
    q16 = q.astype(mx.float16)
    assert mx.array_equal(attention.attention(q16, k, v, scale=0.3, mask="causal"),
                          attention._mlx_attention(q16, k, v, scale=0.3, mask="causal"))


def test_sinks_go_to_mlx_and_bad_mask_mode_is_refused():
    q, k, v = qkv(1, 4, 2, 3, 6, mx.float32, seed=1)
    sinks = mx.array([0.5, -1.0, 0.0, 2.0])
    want = attention._mlx_attention(q, k, v, scale=0.3, mask="causal", sinks=sinks)
    got = attention.attention(q, k, v, scale=0.3, mask="causal", sinks=sinks)
    assert mx.array_equal(got, want)
    with pytest.raises(ValueError, match="mask_mode"):
        attention.attention(q, k, v, scale=0.3, mask="sideways")


def test_installed_replaces_mx_fast_attention_and_restores_it():
    original = mx.fast.scaled_dot_product_attention
    with attention.installed():
        assert mx.fast.scaled_dot_product_attention is attention.attention
    assert mx.fast.scaled_dot_product_attention is original


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_serving_generator_with_it_matches_mlx_lm_with_mlx_attention(arch):
    """The batched, joining generator on this attention gives mlx-lm's generator's tokens
    (logprobs within 1e-4) on MLX's attention: cold rows of different lengths (left
    padding, array masks), warm rows, a sliding window (gemma3_text) and hybrids."""
    model, _ = mlx_lm.load(str(model_path(arch)))
    base = [(11 * i + 5) % 200 + 10 for i in range(48)]
    warm = prefilled(model, base[:40])
    rows = [
        ([base[:20], base[20:37], base[37:40]], None, [], 6),
        ([[base[40]]], warm, base[:40], 6),
        ([[t + 1 for t in base[:27]]], None, [], 5),
        ([base[40:45], [base[45]]], warm, base[:40], 4),
    ]
    want = run(BatchGenerator, model, rows, prefill_batch=4, decode_batch=4)
    with attention.installed():
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
from gateway.cpu.allocator import keep_freed_memory
from test_cpu_attention import MallInfo2
print(keep_freed_memory())
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
@pytest.mark.skipif(not cpu_backend(), reason="the setting applies where MLX runs on the CPU")
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


def test_serve_installs_it_on_the_cpu_unless_turned_off(monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_CPU_ATTENTION", "0")
    assert attention.install_for_cpu_backend() == "MLX_GATEWAY_CPU_ATTENTION=0"
    assert mx.fast.scaled_dot_product_attention is attention._mlx_attention
    monkeypatch.delenv("MLX_GATEWAY_CPU_ATTENTION")
    want = None if cpu_backend() and shutil.which("g++") else ("MLX runs on a GPU" if not cpu_backend() else "no g++")
    try:
        assert attention.install_for_cpu_backend() == want
        assert (mx.fast.scaled_dot_product_attention is attention.attention) == (want is None)
    finally:
        attention.uninstall()
