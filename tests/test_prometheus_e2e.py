"""A real Prometheus scrapes a live gateway with the project's config and rules, and every
PromQL expression of the dashboard and the rules returns data; the token hit rate it
computes equals the gateway's own counters.

Needs ``prometheus`` and ``promtool`` on PATH (Debian: ``apt-get install prometheus``,
which ``.ci/run`` does). Skipped only on machines with no package manager to install
them; anywhere else their absence is a failure.
"""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from conftest import live_server, model_path, wait_until
from promstack import (
    PROM_CONFIG,
    RULES,
    Prometheus,
    binaries,
    dashboard_queries,
    exposed_on_this_platform,
    load_dashboard,
    package_manager,
    rule_queries,
    series_values,
    substitute,
    tenant_setup,
    workload,
)

# A window that covers the whole test, so rates span every sample Prometheus has.
WINDOW = "5m"
HITS = "mlx_gateway_prefix_cache_hits_tokens_total"
QUERIES = "mlx_gateway_prefix_cache_queries_tokens_total"
# The dashboard's token hit rate (overall and per cache group) and per-tenant hit rate.
OVERALL = f"sum(rate({HITS}[$__rate_interval])) / sum(rate({QUERIES}[$__rate_interval]))"
PER_GROUP = (f"sum by (cache_group) (rate({HITS}[$__rate_interval])) / "
             f"sum by (cache_group) (rate({QUERIES}[$__rate_interval]))")
PER_TENANT = ('sum by (tenant) (rate(mlx_gateway_cached_tokens_total{tenant=~"$tenant",model=~"$model"}'
              '[$__rate_interval])) / sum by (tenant) (rate(mlx_gateway_prompt_tokens_total'
              '{tenant=~"$tenant",model=~"$model"}[$__rate_interval]))')
TOLERANCE = 0.01
ALL = {"tenant": ".*", "model": ".*"}  # Grafana's "All"


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


def _evaluate_all(prom: Prometheus, dashboard: list, rules: list) -> list[str]:
    """Evaluate every query; return one line per query without data."""
    failures = []
    # Template variables: label_values(...) through the label values API.
    for q in dashboard:
        if q.label is not None and not prom.label_values(q.label, substitute(q.expr, ALL)):
            failures.append(f"{q.where}: label_values({q.expr}, {q.label}) is empty")
    # Panels with "All" selected, then with every real value selected (Grafana's
    # multi-value regex) for the panels that use a variable.
    real = {name: _regex(prom.label_values(name, "mlx_gateway_requests_total")) for name in ALL}
    for values in (ALL, real):
        for q in dashboard:
            if q.label is None and (values is ALL or "$" in q.expr.replace("$__", "")):
                expr = substitute(q.expr, values, WINDOW)
                if not _finite(prom.query(expr)):
                    failures.append(f"{q.where} ({values}): no finite value for {expr}")
    # Every rule's expression, and the series it records.
    for q in rules:
        if not _finite(prom.query(q.expr)):
            failures.append(f"rule {q.where}: no finite value for {q.expr.strip()}")
        if not _finite(prom.query(q.where)):
            failures.append(f"rule {q.where}: no recorded series")
    return failures


def _check_hit_rates(prom: Prometheus, before: str, after: str) -> None:
    """The hit rates Prometheus computes over the window equal the gateway's own
    counters' increase between the two ``/metrics`` texts."""

    def delta(name: str, label: str) -> dict[str, float]:
        a, b = series_values(before, name, label), series_values(after, name, label)
        return {k: v - a.get(k, 0.0) for k, v in b.items()}

    hits, queries = delta(HITS, "cache_group"), delta(QUERIES, "cache_group")
    overall = sum(hits.values()) / sum(queries.values())
    assert 0.3 < overall < 1, overall  # the workload really hit the cache
    got = _finite(prom.query(substitute(OVERALL, {}, WINDOW)))
    assert got and abs(got[0] - overall) < TOLERANCE, (got, overall)
    rule = _finite(prom.query("mlx_gateway:prefix_cache_token_hit_rate:ratio_rate5m"))
    assert rule and abs(rule[0] - overall) < TOLERANCE, (rule, overall)
    per_group = _by(prom.query(substitute(PER_GROUP, {}, WINDOW)), "cache_group")
    for group, q in queries.items():
        if q > 0:
            assert abs(per_group[group] - hits.get(group, 0.0) / q) < TOLERANCE, (group, per_group)
    cached = delta("mlx_gateway_cached_tokens_total", "tenant")
    prompt = delta("mlx_gateway_prompt_tokens_total", "tenant")
    per_tenant = _by(prom.query(substitute(PER_TENANT, ALL, WINDOW)), "tenant")
    for tenant, p in prompt.items():
        if p > 0:
            assert abs(per_tenant[tenant] - cached.get(tenant, 0.0) / p) < TOLERANCE, (tenant, per_tenant)


def test_prometheus_evaluates_dashboard_and_rules(tmp_path):
    prometheus, promtool = _tools()
    _promtool(promtool, "check", "config", str(PROM_CONFIG))
    _promtool(promtool, "check", "rules", str(RULES))
    dashboard = dashboard_queries(load_dashboard())
    exprs = {q.expr for q in dashboard}
    for e in (OVERALL, PER_GROUP, PER_TENANT):
        assert e in exprs, f"the dashboard no longer has {e}"

    overrides, keys = tenant_setup(tmp_path)
    overrides["prompt_cache_dir"] = str(tmp_path / "prompt-cache")  # the disk tier's panel too
    with live_server(model_path("qwen3"), **overrides) as server:
        client = server.client()
        # Before Prometheus starts: create every series, so that its first sample is this
        # baseline and rates over the whole window are (final - baseline) / time.
        sent = len(workload(server.url, keys))
        before = _metrics_counting(client, sent)
        with Prometheus(server.url.removeprefix("http://"), binary=prometheus) as prom:
            _promtool(promtool, "check", "config", str(prom.config_path))
            prom.wait_for(f"sum({QUERIES})", sum(series_values(before, QUERIES, "cache_group").values()))
            assert prom.targets_up()
            sent += len(workload(server.url, keys))
            after = _metrics_counting(client, sent)
            for name in (QUERIES, HITS):
                prom.wait_for(f"sum({name})", sum(series_values(after, name, "cache_group").values()))
            prom.wait_rounds(2)  # two more scrapes and rule evaluations with the final values
            failures = _evaluate_all(prom, [q for q in dashboard if exposed_on_this_platform(q)], rule_queries())
            assert not failures, "\n".join(failures)
            _check_hit_rates(prom, before, after)
