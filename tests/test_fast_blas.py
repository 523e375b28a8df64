"""Linux CPU: the gateway runs MLX's matmuls on the system OpenBLAS, not the reference
BLAS bundled with mlx[cpu] (re-executing itself with it preloaded), and warns when
OpenBLAS is missing."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from gateway.cpu import blas as fast_blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU backend only")

PROBE = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
         "from gateway.backend import backend; from gateway.cpu.blas import openblas_loaded; "
         "backend().start(None); print(openblas_loaded(), sys.argv[1:])")
CHOICE = re.compile(r"BLAS \[.*\]: (\w+) \(measured: bundled ([0-9.]+) ms, openblas ([0-9.]+) ms\)")


def run_probe(**env_extra) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MLX_GATEWAY_FAST_BLAS", "OPENBLAS_THREAD_TIMEOUT")}
    env.update(env_extra)
    done = subprocess.run([sys.executable, "-c", PROBE, "--flag", "x y"], env=env, capture_output=True,
                          text=True, check=True, timeout=120)
    return done.stdout.strip(), done.stderr


def test_reexecutes_with_the_blas_that_measured_faster_keeping_the_arguments():
    """OpenBLAS is timed in the re-executed process against the bundled BLAS's figure; the
    process ends up with the one the logged measurement chose."""
    if fast_blas.find_openblas() is None:
        pytest.skip("no system OpenBLAS here: install libopenblas0-pthread (.ci/run does)")
    out, log = run_probe()
    (chosen, bundled, openblas), = CHOICE.findall(log)
    assert chosen == fast_blas.decide({"bundled": float(bundled), "openblas": float(openblas)})
    assert out == f"{chosen == 'openblas'} ['--flag', 'x y']"
    assert ("OPENBLAS_THREAD_TIMEOUT=4" in log) == (chosen == "openblas")


@pytest.mark.parametrize("seconds,want", [({"bundled": 0.0110, "openblas": 0.0004}, "openblas"),
                                          ({"bundled": 0.0010, "openblas": 0.0010}, "bundled"),
                                          ({"bundled": 0.0010, "openblas": 0.0030}, "bundled")])
def test_the_choice_follows_the_measurement(seconds, want):
    assert fast_blas.decide(seconds) == want


def test_model_shapes_come_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 160}')
    assert fast_blas.matmul_shape(str(tmp_path)) == (64, 160)
    assert fast_blas.matmul_shape(str(tmp_path / "missing")) == fast_blas.DEFAULT_SHAPE
    assert fast_blas.matmul_shape(None) == fast_blas.DEFAULT_SHAPE


def test_can_be_turned_off():
    assert run_probe(MLX_GATEWAY_FAST_BLAS="0")[0] == "False ['--flag', 'x y']"


def test_warns_with_the_install_command_when_openblas_is_missing(monkeypatch, caplog):
    monkeypatch.delenv("MLX_GATEWAY_FAST_BLAS", raising=False)
    monkeypatch.setattr(fast_blas, "openblas_loaded", lambda: False)
    monkeypatch.setattr(fast_blas, "find_openblas", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute without a library"))
    with caplog.at_level(logging.WARNING, logger="mlx_gateway"):
        fast_blas.ensure_fast_blas()
    assert "libopenblas0-pthread" in caplog.text and "reference BLAS" in caplog.text


class Reexecuted(Exception):
    pass


def reexec_env(monkeypatch) -> dict:
    """The environment ``ensure_fast_blas`` re-executes with, OpenBLAS installed and not loaded."""
    for name in ("LD_PRELOAD", "MLX_GATEWAY_FAST_BLAS", fast_blas.BUNDLED_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(fast_blas, "openblas_loaded", lambda: False)
    monkeypatch.setattr(fast_blas, "find_openblas", lambda: "/usr/lib/libopenblas.so.0")
    monkeypatch.setattr(fast_blas, "time_matmul", lambda shape: 0.01)
    seen = {}

    def execve(path, argv, env):
        seen.update(env)
        raise Reexecuted

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Reexecuted):
        fast_blas.ensure_fast_blas()
    return seen


def test_the_reexecution_sets_the_openblas_thread_timeout_unless_the_user_did(monkeypatch):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads, so it travels in the re-executed
    environment; a value the user set is kept."""
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    env = reexec_env(monkeypatch)
    assert env["LD_PRELOAD"] == "/usr/lib/libopenblas.so.0"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == fast_blas.THREAD_TIMEOUT == "4"
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "12")
    assert reexec_env(monkeypatch)["OPENBLAS_THREAD_TIMEOUT"] == "12"
