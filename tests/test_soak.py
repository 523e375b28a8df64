"""A CI-sized soak (benchmarks/soak.py): a minute of mixed traffic (agent sessions with
tools on three APIs, images, embeddings, cancels mid-stream, bad inputs, model loads and
unloads) against a real gateway process; after the warm-up its resident memory plateaus,
and once traffic stops no lease, row, asyncio task or descriptor is left over."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from conftest import free_port, model_path
from gateway.cpu.idle_trim import heap_free_bytes

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)

RSS_GROWTH = 0.02  # the bound: under 2 % after the warm-up


def test_growth_compares_window_medians():
    assert soak.growth([100.0] * 9) == 0
    assert abs(soak.growth([100, 100, 100, 500, 100, 100, 102, 102, 102]) - 0.02) < 1e-9  # one burst decides nothing
    assert abs(soak.slope_per_hour([0, 3600], [1.0, 3.0]) - 2.0) < 1e-9


def test_a_short_soak_plateaus_and_leaks_nothing():
    gw = soak.Gateway(str(model_path("qwen3")), str(model_path("gemma3")), str(model_path("qwen3_embedding")),
                      ["--prompt-cache-bytes", "64M"], free_port())
    try:
        gw.wait_healthy()
        report = asyncio.run(soak.soak(gw, duration=40, warmup=15, workers=4, sample_every=1, load_every=10))
        assert gw.proc.poll() is None, gw.output()
    finally:
        gw.close()
    print(soak.table(report))
    print("growth", report["rss_growth"], "slope MB/h", report["rss_mb_per_hour"], "leaks", report["leaks"])
    assert not report["failures"], report["failures"]
    seen = {k.split()[0] for k in report["statuses"]}
    assert {"chat_agent", "messages_agent", "responses_agent", "vision", "embeddings", "cancel", "bad_input",
            "admin_load", "admin_unload", "spare"} <= seen, seen
    assert len(report["samples"]) >= 20
    if heap_free_bytes() is not None:  # glibc's mallinfo2 (2.33+): the freed arrays malloc keeps
        assert max(s["heap_free_mb"] for s in report["samples"]) > 0, soak.table(report)
    assert report["rss_growth"] < RSS_GROWTH, soak.table(report)
    leaks = report["leaks"]
    assert leaks["leases"] == 0 and leaks["rows"] == 0, leaks
    assert leaks["tasks"] <= 0 and leaks["fds"] <= 0, (leaks, soak.table(report))


def test_loading_and_unloading_a_model_leaves_its_weights_nowhere():
    """Found by the soak: every load froze the model's objects (gc.freeze) and an unload
    left them in the frozen generation, so MLX's active memory grew by the weights at each
    load and unload. After the first cycle, more cycles add nothing."""
    import httpx

    gw = soak.Gateway(str(model_path("qwen3")), None, None, [], free_port())
    try:
        gw.wait_healthy()
        with httpx.Client(base_url=gw.url, timeout=300) as c:
            def cycle() -> float:
                assert c.post("/admin/models/spare/load").status_code == 200
                r = c.post("/v1/chat/completions", json={"model": "spare", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
                assert c.post("/admin/models/spare/unload").status_code == 200
                return soak.parse_metrics(c.get("/metrics").text)["mlx_active_mb"]

            weights_mb = [s.value for f in soak.text_string_to_metric_families(c.get("/metrics").text)
                          for s in f.samples if s.name == "mlx_gateway_model_weights_bytes"
                          and s.labels["model"] == "chat"][0] / 1e6
            first = cycle()
            after = [cycle() for _ in range(4)]
    finally:
        gw.close()
    assert max(after) - first < weights_mb / 2, (first, after, weights_mb)  # a leak: +weights per cycle
