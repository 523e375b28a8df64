"""The request log breaks a streamed request's time to first token into phases (HTTP
admission, parse, template, thread hop, queue, cache fetch, prefill, first decode,
hand-over to the event loop, first write), each measured, none negative."""

from __future__ import annotations

import logging

import httpx

from conftest import live_server, model_path
from gateway.telemetry.request_log import PHASES


def test_streamed_request_logs_every_phase(caplog):
    caplog.set_level(logging.INFO, logger="mlx_gateway.requests")
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hello there " * 30}],
            "max_tokens": 4, "stream": True}
    with live_server(model_path("qwen3")) as server:
        for _ in range(2):  # cold, then a prefix-cache hit
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                r.read()
    lines = [r.record for r in caplog.records if r.name == "mlx_gateway.requests"]
    assert len(lines) == 2
    for line in lines:
        phases = line["phases"]
        assert set(phases) == {name for name, _, _ in PHASES}, phases
        assert all(v >= 0 for v in phases.values()), phases
        assert sum(phases.values()) <= line["total_seconds"]
    assert lines[1]["cached_tokens"] > 0
