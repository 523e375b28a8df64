"""The backend is decided once, from MLX's default device, and each backend's tuning is
what it should be: decided here from device facts passed in (a Mac's ``mx.device_info()``
cannot be had on Linux), and on this machine through the real ``backend()``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from gateway import backend as backend_module
from gateway.backend import BUDGET_SHARE, FALLBACK_BUDGET, CpuTuning, MetalTuning, Tuning, kind_of, tuning_for

GiB = 1 << 30
# what mx.device_info() gives on a 32 GB M2 Pro (the keys the Metal tuning reads)
MAC = {"architecture": "applegpu_g14s", "device_name": "Apple M2 Pro", "memory_size": 32 * GiB,
       "max_recommended_working_set_size": 22 * GiB, "max_buffer_length": 16 * GiB}


@pytest.mark.parametrize("device,metal,cuda,want", [
    ("cpu", False, False, "cpu"),  # mlx[cpu] on Linux
    ("gpu", True, False, "metal"),  # Apple silicon
    ("cpu", True, False, "cpu"),  # a Mac told to compute on the CPU
    ("gpu", False, True, "cuda"),  # mlx[cuda]
    ("cpu", False, True, "cpu"),
    ("gpu", False, False, "cpu"),  # no GPU backend after all: MLX computes on the CPU
])
def test_the_kind_follows_the_default_device(device, metal, cuda, want):
    assert kind_of(device, metal, cuda) == want


def test_metal_budget_is_the_recommended_working_set():
    tuning = tuning_for("metal", MAC, 30 * GiB)
    assert isinstance(tuning, MetalTuning) and tuning.kind == "metal"
    assert tuning.memory_budget() == 22 * GiB != int(BUDGET_SHARE * 32 * GiB)
    assert tuning.budget_source == "Metal's recommended working set"
    assert tuning.merge_streams == 1 and not tuning.trims_idle
    no_figure = tuning_for("metal", {}, 32 * GiB)
    assert no_figure.memory_budget() == int(BUDGET_SHARE * 32 * GiB) and "75%" in no_figure.budget_source


def test_metal_wires_the_weights_up_to_the_working_set(monkeypatch):
    import mlx.nn as nn

    wired = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    tuning = MetalTuning({**MAC, "max_recommended_working_set_size": 10_000})
    model = nn.Linear(40, 50)  # 40 * 50 + 50 float32: 8,200 bytes
    assert tuning.prepare(model) == []
    tuning.prepare(model)  # a second model: the two together, at most the working set
    assert wired == [8_200, 10_000] and tuning.wired == 10_000
    assert tuning.served_bytes(model) == 8_200  # weights served as stored
    MetalTuning({}).prepare(model)  # no working set known: the limit is left alone
    assert wired == [8_200, 10_000]


def test_cuda_and_cpu_budgets_are_a_share_of_the_memory():
    cuda = tuning_for("cuda", {"device_name": "NVIDIA H200"}, 100 * GiB)
    assert type(cuda) is Tuning and cuda.kind == "cuda"
    assert cuda.memory_budget() == int(BUDGET_SHARE * 100 * GiB)
    cpu = tuning_for("cpu", {}, 8 * GiB)
    assert isinstance(cpu, CpuTuning) and cpu.memory_budget() == 6 * GiB
    assert tuning_for("cpu", {}, None).memory_budget() == FALLBACK_BUDGET


def test_the_process_decides_once_from_its_default_device():
    first = backend_module.backend()
    assert backend_module.backend() is first
    device = mx.default_device().type.name
    assert first.kind == kind_of(device, mx.metal.is_available(), mx.cuda.is_available())


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="MLX computes on the CPU here")
def test_on_the_cpu_the_tuning_measures_and_keeps_the_choices(monkeypatch):
    import mlx_lm

    from conftest import model_path
    from gateway.cpu import attention

    monkeypatch.setenv("MLX_GATEWAY_MALLOC_TUNE", "0")  # glibc's settings are the test process's
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    tuning = CpuTuning(8 * GiB)
    assert tuning.merge_streams == 1 and tuning.merges is None
    try:
        unmeasured = tuning.prepare(model, measure=False)
        assert [c.chosen for c in unmeasured] == ["MLX's own"] and tuning.merges is None
        choices = tuning.prepare(model, rounds=1)
        assert choices[-1].what == "CPU path measurements"
        assert tuning.merges is not None and tuning.merge_streams in (1, 2)
        (shape,) = attention.attention_shapes(model)
        assert tuning.attention.planned(*shape) is not None
    finally:
        attention.uninstall()
