"""Linux CPU: the gateway runs MLX's matmuls on the system OpenBLAS, not the reference
BLAS bundled with mlx[cpu] (re-executing itself with it preloaded), and warns when
OpenBLAS is missing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gateway.cpu import blas as fast_blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU backend only")

PROBE = ("import sys; from gateway.cpu.blas import ensure_fast_blas, openblas_loaded; "
         "ensure_fast_blas(); print(openblas_loaded(), sys.argv[1:])")


def run_probe(**env_extra) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_GATEWAY_FAST_BLAS")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", PROBE, "--flag", "x y"], env=env, capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()


def test_reexecutes_with_openblas_preloaded_keeping_the_arguments():
    if fast_blas.find_openblas() is None:
        pytest.skip("no system OpenBLAS here: install libopenblas0-pthread (.ci/run does)")
    assert run_probe() == "True ['--flag', 'x y']"


def test_can_be_turned_off():
    assert run_probe(MLX_GATEWAY_FAST_BLAS="0") == "False ['--flag', 'x y']"


def test_warns_with_the_install_command_when_openblas_is_missing(monkeypatch, caplog):
    monkeypatch.delenv("MLX_GATEWAY_FAST_BLAS", raising=False)
    monkeypatch.setattr(fast_blas, "openblas_loaded", lambda: False)
    monkeypatch.setattr(fast_blas, "find_openblas", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute without a library"))
    with caplog.at_level(logging.WARNING, logger="mlx_gateway"):
        fast_blas.ensure_fast_blas()
    assert "libopenblas0-pthread" in caplog.text and "reference BLAS" in caplog.text
