"""A real Prometheus scrapes a live gateway with the project's config and rules, and every
PromQL expression of the dashboard and the rules returns data; the token hit rate it
computes equals the gateway's own counters. The gateway serves two models, the second
unloaded and loaded again while Prometheus scrapes, so that the Models row's load and
unload series move; its tenants' requests come in every latency class and one from an
Origin its key is not bound to, for the Latency classes row; and it shares its tenants'
limits through a real Redis (``--limits-store``), the only way it exports the Cluster row's
``mlx_gateway_limits_store_up``.

Needs ``prometheus``, ``promtool`` and ``redis-server`` on PATH (Debian: ``apt-get install
prometheus redis-server``, which ``.ci/run`` does). Skipped only on machines with no package
manager to install them; anywhere else their absence is a failure.
"""

from __future__ import annotations

import math
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Callable

import httpx
import pytest

from conftest import live_server, model_path, wait_until
from promstack import (
    ADMIN_KEY,
    PROM_CONFIG,
    RULES,
    Prometheus,
    binaries,
    dashboard_queries,
    exposed_on_this_platform,
    load_dashboard,
    package_manager,
    row_panels,
    rule_queries,
    series_values,
    substitute,
    tenant_setup,
    workload,
)
from redis_server import RedisServer, require_redis

# A window that covers the whole test, so rates span every sample Prometheus has.
WINDOW = "5m"
HITS = "mlx_gateway_prefix_cache_hits_tokens_total"
QUERIES = "mlx_gateway_prefix_cache_queries_tokens_total"
# The dashboard's token hit rate (overall, per cache group and per replica) and per-tenant hit rate.
M = 'model=~"$model",instance=~"$instance"'
OVERALL = (f'sum(rate({HITS}{{{M}}}[$__rate_interval])) / '
           f'sum(rate({QUERIES}{{{M}}}[$__rate_interval]))')
PER_GROUP = (f'sum by (cache_group) (rate({HITS}{{{M}}}[$__rate_interval])) / '
             f'sum by (cache_group) (rate({QUERIES}{{{M}}}[$__rate_interval]))')
PER_REPLICA = (f'sum by (instance) (rate({HITS}{{{M}}}[$__rate_interval])) / '
               f'sum by (instance) (rate({QUERIES}{{{M}}}[$__rate_interval]))')
PER_TENANT = ('sum by (tenant) (rate(mlx_gateway_cached_tokens_total{tenant=~"$tenant",model=~"$model",'
              'instance=~"$instance"}[$__rate_interval])) / sum by (tenant) (rate(mlx_gateway_prompt_tokens_total'
              '{tenant=~"$tenant",model=~"$model",instance=~"$instance"}[$__rate_interval]))')
TOLERANCE = 0.01
ALL = {"instance": ".*", "tenant": ".*", "model": ".*"}  # Grafana's "All"
# The models: the workload's (the first, which answers requests that name none), and a
# spare one asked once before Prometheus starts, then unloaded and loaded again by an
# admin while Prometheus scrapes. Hit rates are checked for MODEL with the dashboard's
# model variable set to it.
MODEL, SPARE = "test-model", "spare"
ONE = {"instance": ".*", "tenant": ".*", "model": MODEL}
CLASSES = ("interactive", "standard", "batch")  # the priority label of the class histograms; 0, 1, 2 elsewhere


def _tools() -> tuple[str, str]:
    prometheus, promtool = binaries()
    if prometheus and promtool:
        return prometheus, promtool
    manager = package_manager()
    if manager is None:
        pytest.skip("prometheus and promtool are not on PATH and this machine has no package manager "
                    "to install them (Debian: apt-get install prometheus; macOS: brew install prometheus)")
    pytest.fail(f"prometheus and promtool are not on PATH; install them with {manager} "
                "(.ci/run does: apt-get install prometheus)")


def _promtool(promtool: str, *args: str) -> None:
    r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}"


def _finite(result: list[dict]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]


def _by(result: list[dict], label: str) -> dict[str, float]:
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in result}


def _regex(values: list[str]) -> str:
    """Grafana's multi-value regex: metacharacters escaped for a PromQL string."""
    return "(" + "|".join(re.sub(r"([\\^$*+?.()|\[\]{}])", r"\\\\\1", v) for v in values) + ")"


def _metrics_counting(client, n: int) -> str:
    """The gateway's ``/metrics`` once it has counted ``n`` chat requests: the middleware
    counts a request (last of all its figures) just after the client has the answer."""

    def text():
        t = client.get("/metrics").text
        counted = series_values(t, "mlx_gateway_requests_total", "endpoint").get("/v1/chat/completions", 0)
        assert counted <= n, f"the gateway counted {counted} chat requests, {n} were sent"
        return t if counted == n else None

    return wait_until(text, 10, f"the gateway to count the {n} chat requests sent")


def _specs(path, overrides: dict) -> list:
    """MODEL as ``live_server`` serves a lone model (pinned, loaded at start), and SPARE:
    the same model with other random weights (two models of the same files would share
    a disk-tier directory, which one model at a time may hold), loaded on first use,
    never unloaded but by an admin."""
    from gateway.config import ServeConfig
    from gateway.models.demo_model import build_model_dir
    from gateway.models.spec import model_specs

    spare = build_model_dir(path.parent / f"{path.name}-seed1", "qwen3", tokenizer_dir=path, seed=1)
    base = model_specs(ServeConfig(model=str(path), **overrides))[0]
    return [replace(base, name=MODEL),
            replace(base, name=SPARE, path=str(spare), pin=False, preload=False, keep_alive=None)]


def _admin(client: httpx.Client, keys: list, action: str, model: str) -> None:
    """``POST /admin/models/{model}/{action}``, again while the model is busy (409: the
    request that used it last is still releasing it)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if keys != [None] else {}

    def done():
        r = client.post(f"/admin/models/{model}/{action}", headers=headers, timeout=60)
        assert r.status_code in (200, 409), r.text
        return r.status_code == 200 or None

    wait_until(done, 10, f"the admin to {action} {model}")


def _evaluate_all(prom: Prometheus, dashboard: list, rules: list) -> list[str]:
    """Evaluate every query (a few at a time); return one line per query without data."""
    checks: list[tuple[str, Callable[[], object]]] = []  # (failure, what is truthy when it has data)
    # Template variables: label_values(...) through the label values API.
    for q in dashboard:
        if q.label is not None:
            checks.append((f"{q.where}: label_values({q.expr}, {q.label}) is empty",
                           partial(prom.label_values, q.label, substitute(q.expr, ALL))))
    # Panels with "All" selected, then with every real value selected (Grafana's
    # multi-value regex) for the panels that use a variable.
    real = {name: _regex(prom.label_values(name, "mlx_gateway_requests_total")) for name in ALL}
    for values in (ALL, real):
        for q in dashboard:
            if q.label is None and (values is ALL or "$" in q.expr.replace("$__", "")):
                expr = substitute(q.expr, values, WINDOW)
                checks.append((f"{q.where} ({values}): no finite value for {expr}",
                               partial(_finite_query, prom, expr)))
    # Every rule's expression, and the series it records.
    for q in rules:
        checks.append((f"rule {q.where}: no finite value for {q.expr.strip()}",
                       partial(_finite_query, prom, q.expr)))
        checks.append((f"rule {q.where}: no recorded series", partial(_finite_query, prom, q.where)))
    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda check: check[1](), checks))
    return [failure for (failure, _), data in zip(checks, found) if not data]


def _finite_query(prom: Prometheus, expr: str) -> list[float]:
    return _finite(prom.query(expr))


def _check_hit_rates(prom: Prometheus, before: str, after: str) -> None:
    """The hit rates Prometheus computes over the window for MODEL equal the increase of
    MODEL's own counters between the two ``/metrics`` texts; so does the rule's (every
    model's: SPARE's counters went back to 0 with its reload, an increase of 0)."""

    def delta(name: str, label: str) -> dict[str, float]:
        a, b = series_values(before, name, label, model=MODEL), series_values(after, name, label, model=MODEL)
        return {k: v - a.get(k, 0.0) for k, v in b.items()}

    hits, queries = delta(HITS, "cache_group"), delta(QUERIES, "cache_group")
    overall = sum(hits.values()) / sum(queries.values())
    assert 0.3 < overall < 1, overall  # the workload really hit the cache
    got = _finite(prom.query(substitute(OVERALL, ONE, WINDOW)))
    assert got and abs(got[0] - overall) < TOLERANCE, (got, overall)
    rule = _finite(prom.query("mlx_gateway:prefix_cache_token_hit_rate:ratio_rate5m"))
    assert rule and abs(rule[0] - overall) < TOLERANCE, (rule, overall)
    per_group = _by(prom.query(substitute(PER_GROUP, ONE, WINDOW)), "cache_group")
    for group, q in queries.items():
        if q > 0:
            assert abs(per_group[group] - hits.get(group, 0.0) / q) < TOLERANCE, (group, per_group)
    cached = delta("mlx_gateway_cached_tokens_total", "tenant")
    prompt = delta("mlx_gateway_prompt_tokens_total", "tenant")
    per_tenant = _by(prom.query(substitute(PER_TENANT, ONE, WINDOW)), "tenant")
    for tenant, p in prompt.items():
        if p > 0:
            assert abs(per_tenant[tenant] - cached.get(tenant, 0.0) / p) < TOLERANCE, (tenant, per_tenant)


def _panel_query(prom: Prometheus, panels: list[dict], title: str, ref: str = "A",
                 values: dict = ALL) -> list[dict]:
    """The result of the target ``ref`` of the panel ``title`` (of ``panels``), over the window."""
    panel = next(p for p in panels if p["title"] == title)
    t = next(t for t in panel["targets"] if t["refId"] == ref)
    return prom.query(substitute(t["expr"], values, WINDOW))


def _by_legend(prom: Prometheus, panels: list[dict], title: str) -> dict[str, float]:
    """Legend -> value of the panel ``title``'s targets (each one series, named by its legend)."""
    panel = next(p for p in panels if p["title"] == title)
    out = {}
    for t in panel["targets"]:
        res = _panel_query(prom, panels, title, t["refId"])
        assert len(res) == 1, (title, t["legendFormat"], res)
        out[t["legendFormat"]] = float(res[0]["value"][1])
    return out


def _check_classes_row(prom: Prometheus, dash: dict, before: str, after: str) -> None:
    """The Latency classes row (every variable on All) has a TTFT and an inter-token gap for
    each class the workload used (bob's interactive, alice's and carol's standard, the
    requests asking for batch); the queue, pauses and resumes of each class under its name,
    as the gateway counts them; and the origin refusals of alice's key only."""
    panels = row_panels(dash)["Latency classes"]
    for title in ("Time to first token by class", "Inter-token gap by class"):
        for ref in ("A", "B"):
            got = {k: v for k, v in _by(_panel_query(prom, panels, title, ref), "priority").items()
                   if math.isfinite(v)}
            assert set(got) == set(CLASSES) and all(v > 0 for v in got.values()), (title, ref, got)
    queued = _by_legend(prom, panels, "Queued by class")
    gauge = series_values(after, "mlx_gateway_requests_queued_by_class", "priority")
    assert queued == {name: gauge[str(i)] for i, name in enumerate(CLASSES)}, (queued, gauge)
    moved = _by_legend(prom, panels, "Pauses, resumes and decode holds / s")
    assert set(moved) == {f"{what} {name}" for what in ("paused", "resumed") for name in CLASSES} | {
        "decoding paused standard", "decoding paused batch", "steps holding lower-class decoding"}, moved
    for what, name, classes in (("paused", "mlx_gateway_prefill_pauses_total", CLASSES),
                                ("resumed", "mlx_gateway_prefill_resumes_total", CLASSES),
                                ("decoding paused", "mlx_gateway_decode_pauses_total", CLASSES[1:])):
        a, b = series_values(before, name, "priority"), series_values(after, name, "priority")
        for cls in classes:
            i, rate = CLASSES.index(cls), moved[f"{what} {cls}"]
            assert math.isfinite(rate) and (rate > 0) == (b[str(i)] > a.get(str(i), 0.0)), (what, cls, rate, a, b)
    assert math.isfinite(moved["steps holding lower-class decoding"])
    refused = _by(_panel_query(prom, panels, "Origin refused (403) / s by tenant"), "tenant")
    assert {t for t, v in refused.items() if v > 0} == {"alice"}, refused
    counted = series_values(after, "mlx_gateway_origin_refused_total", "tenant")
    assert set(refused) == set(counted) and counted["alice"] > 0, (refused, counted)


def _check_cluster_row(prom: Prometheus, dash: dict, target: str) -> None:
    """The Cluster row, with the instance variable on All and on the one replica scraped:
    one series per replica (its scrape address), the hit rate the same as the overall one,
    decode tokens generated, no request left running or waiting, the limits store up."""
    panels = row_panels(dash)["Cluster"]
    assert prom.label_values("instance", "mlx_gateway_requests_total") == [target]
    one = dict(ONE, instance=_regex([target]))
    for values in (ONE, one):
        overall = _finite(prom.query(substitute(OVERALL, values, WINDOW)))
        per_replica = _by(_panel_query(prom, panels, "Token hit rate by replica", values=values), "instance")
        assert set(per_replica) == {target} and abs(per_replica[target] - overall[0]) < TOLERANCE, per_replica
        assert _by(_panel_query(prom, panels, "Load by replica", "A", values), "instance") == {target: 0.0}
        decode = _by(_panel_query(prom, panels, "Load by replica", "B", values), "instance")
        assert set(decode) == {target} and decode[target] > 0, decode
        assert _by(_panel_query(prom, panels, "Waiting by replica", values=values), "instance") == {target: 0.0}
        assert _by(_panel_query(prom, panels, "Limits store by replica", values=values), "instance") == {target: 1.0}
    nobody = dict(ONE, instance=_regex(["no-such-replica:1"]))
    assert not _panel_query(prom, panels, "Token hit rate by replica", values=nobody)


def _check_models_row(prom: Prometheus, dash: dict, after: str) -> None:
    """The Models row's queries (model variable on All) say what the gateway does: both
    models loaded, their weights under the budget, SPARE's reload timed and its unload
    counted with reason admin."""
    panels = {p["title"]: p for p in row_panels(dash)["Models"]}

    def query(title: str, ref: str = "A") -> list[dict]:
        t = next(t for t in panels[title]["targets"] if t["refId"] == ref)
        return prom.query(substitute(t["expr"], ALL, WINDOW))

    assert _by(query("Models loaded"), "model") == {MODEL: 1.0, SPARE: 1.0}
    weights = _by(query("Weights and memory budget"), "model")
    assert weights == series_values(after, "mlx_gateway_model_weights_bytes", "model"), weights
    assert set(weights) == {MODEL, SPARE} and all(w > 0 for w in weights.values()), weights
    budget = _finite(query("Weights and memory budget", "B"))
    assert budget and budget[0] > sum(weights.values()), (budget, weights)
    assert _by(query("Prefix cache by model"), "model").get(MODEL, 0) > 0
    load = {m: v for m, v in _by(query("Model load time"), "model").items() if math.isfinite(v)}
    assert set(load) == {SPARE} and load[SPARE] > 0, load  # MODEL's only load was before Prometheus
    assert all(v > 0 for v in _by(query("Model load time", "B"), "model").values())
    unloads = {(s["metric"]["model"], s["metric"]["reason"]): float(s["value"][1])
               for s in query("Unloads by reason")}
    assert {k for k, v in unloads.items() if v > 0} == {(SPARE, "admin")}, unloads
    assert set(_by(query("Requests in flight by model"), "model")) == {MODEL, SPARE}


def test_prometheus_evaluates_dashboard_and_rules(tmp_path):
    prometheus, promtool = _tools()
    _promtool(promtool, "check", "config", str(PROM_CONFIG))
    _promtool(promtool, "check", "rules", str(RULES))
    dash = load_dashboard()
    dashboard = dashboard_queries(dash)
    exprs = {q.expr for q in dashboard}
    for e in (OVERALL, PER_GROUP, PER_REPLICA, PER_TENANT):
        assert e in exprs, f"the dashboard no longer has {e}"

    overrides, keys = tenant_setup(tmp_path)
    overrides["prompt_cache_dir"] = str(tmp_path / "prompt-cache")  # the disk tier's panel too
    overrides["speculative"] = "ngram"  # and the speculative decoding panel
    path = model_path("qwen3")
    import mlx_lm
    from test_lora import write_mlx_lm

    adapter = write_mlx_lm(tmp_path / "tone", mlx_lm.load(str(path))[0], 1)
    overrides["lora_modules"] = [f"tone={adapter}"]  # and the LoRA adapters row (primed per served adapter)
    with RedisServer(require_redis()) as redis, \
            live_server(path, _specs(path, overrides), limits_store=redis.url, **overrides) as server:
        # Not the 50 ms of a request's wait: a loaded machine must not fall back to local limits.
        server.front.limiter.store.timeout = 5.0
        client = server.client()
        # Before Prometheus starts: create every series, so that its first sample is this
        # baseline and rates over the whole window are (final - baseline) / time. One
        # request loads SPARE and lists it among the model variable's values.
        sent = len(workload(server.url, keys))
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys[0] else {}
        r = client.post("/v1/chat/completions", headers=headers, timeout=120, json={
            "model": SPARE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        sent += 1
        for _ in range(2):  # and the adapter's series: its cache group's queries, then hits
            r = client.post("/v1/chat/completions", headers=headers, timeout=120, json={
                "model": "tone", "messages": [{"role": "user", "content": "tone"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            sent += 1
        before = _metrics_counting(client, sent)
        with Prometheus(server.url.removeprefix("http://"), binary=prometheus) as prom:
            _promtool(promtool, "check", "config", str(prom.config_path))
            prom.wait_for(f'sum({QUERIES}{{model="{MODEL}"}})',
                          sum(series_values(before, QUERIES, "cache_group", model=MODEL).values()))
            assert prom.targets_up()
            _admin(client, keys, "unload", SPARE)  # scraped before: its load and unload move
            _admin(client, keys, "load", SPARE)
            # new questions beside repeated ones (exact repeats alone would prefill nothing)
            sent += len(workload(server.url, keys, first_round=1))
            # answers under the adapter, for its row's rates: after the workload (sent before
            # it, they left the window with no speculative draft of the workload's)
            for n in range(2):
                r = client.post("/v1/chat/completions", headers=headers, timeout=120, json={
                    "model": "tone", "messages": [{"role": "user", "content": f"tone {n}"}], "max_tokens": 2})
                assert r.status_code == 200, r.text
                sent += 1
            after = _metrics_counting(client, sent)
            for name in (QUERIES, HITS):
                prom.wait_for(f'sum({name}{{model="{MODEL}"}})',
                              sum(series_values(after, name, "cache_group", model=MODEL).values()))
            prom.wait_rounds(2)  # two more scrapes and rule evaluations with the final values
            # Every check below reads the state of one instant (the queries' load may make
            # the gateway miss a later scrape).
            prom.settle()
            failures = _evaluate_all(prom, [q for q in dashboard if exposed_on_this_platform(q)], rule_queries())
            assert not failures, "\n".join(failures)
            _check_hit_rates(prom, before, after)
            _check_models_row(prom, dash, after)
            _check_classes_row(prom, dash, before, after)
            _check_cluster_row(prom, dash, server.url.removeprefix("http://"))
