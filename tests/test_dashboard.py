"""The Grafana dashboard, the recording rules and the deploy bundle read only metrics a
live gateway exposes, and the bundle's files agree with each other."""

from __future__ import annotations

import plistlib
import re

import yaml

from conftest import live_server, model_path
from promstack import (
    DASHBOARD,
    PROM_CONFIG,
    ROOT,
    RULES,
    Query,
    dashboard_queries,
    exposed_on_this_platform,
    exposed_samples,
    labelled_samples,
    load_dashboard,
    metric_names,
    row_panels,
    rule_queries,
    selectors,
    substitute,
    tenant_setup,
    workload,
)

ALL = {"tenant": ".*", "model": ".*"}
MODEL = 'model=~"$model"'
# Series with a model label that the model variable must not filter: build_info's model
# is the first served model, not the model of the series.
NOT_PER_MODEL = {"mlx_gateway_build_info"}
# What the Models row shows: metric names its panels must read.
MODELS_ROW = {"mlx_gateway_model_loaded", "mlx_gateway_model_weights_bytes", "mlx_gateway_memory_budget_bytes",
              "mlx_gateway_prompt_cache_bytes", "mlx_gateway_model_unloads_total",
              "mlx_gateway_model_requests_in_flight"}


def missing_metrics(queries: list[Query], exposed: set[str], records: set[str]) -> dict[str, list[str]]:
    """Metric name -> where it is used, for names neither exposed nor recorded by a rule
    (recorded names contain ``:``)."""
    out: dict[str, list[str]] = {}
    for q in queries:
        for name in metric_names(substitute(q.expr, ALL)):
            if name not in (records if ":" in name else exposed):
                out.setdefault(name, []).append(q.where)
    return out


def unfiltered(queries: list[Query], labelled: set[str]) -> dict[str, list[str]]:
    """Metric name -> the panels where a selector of it, a name of ``labelled`` (series
    with a ``model`` label), lacks the ``model=~"$model"`` matcher of the model variable."""
    out: dict[str, list[str]] = {}
    for q in queries:
        if not q.where.startswith("panel "):
            continue  # the variables' label_values queries list the models themselves
        for name in sorted(metric_names(q.expr) & labelled - NOT_PER_MODEL):
            if any(MODEL not in m.replace(" ", "") for m in selectors(q.expr, name)):
                out.setdefault(name, []).append(q.where)
    return out


def overlaps(panels: list[dict]) -> list[tuple[str, str]]:
    """Pairs of panels (titles) whose gridPos rectangles intersect."""
    out = []
    for i, a in enumerate(panels):
        for b in panels[i + 1:]:
            ga, gb = a["gridPos"], b["gridPos"]
            if (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
                    and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"]):
                out.append((a["title"], b["title"]))
    return out


def test_dashboard_shape():
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] == "mlx-gateway"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("tenant", "model"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        assert "label_values(mlx_gateway_requests_total" in v["definition"], name
        assert v["datasource"]["uid"] == "${datasource}"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for title in ("Cache reuse", "Latency", "Throughput", "Tenants", "Models"):
        assert title in rows
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert not overlaps(dash["panels"])
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert p.get("description"), p["title"]
    models = row_panels(dash)["Models"]
    assert len(models) >= 6
    read = set().union(*(metric_names(t["expr"]) for p in models for t in p["targets"]))
    assert MODELS_ROW <= read, MODELS_ROW - read
    assert any(n.startswith("mlx_gateway_model_load_seconds_") for n in read)
    for p in models:
        assert all(MODEL in t["expr"] for t in p["targets"] if "budget" not in t["expr"]), p["title"]


def test_checks_report_bad_layout_and_missing_model_filters():
    """The checks above can fail: overlapping panels, a model-labelled series read
    without the model variable."""
    a = {"title": "a", "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8}}
    b = {"title": "b", "gridPos": {"x": 8, "y": 4, "w": 8, "h": 8}}
    c = {"title": "c", "gridPos": {"x": 12, "y": 0, "w": 12, "h": 4}}  # touches a and b only
    d = {"title": "d", "gridPos": {"x": 14, "y": 10, "w": 4, "h": 4}}
    assert overlaps([a, b, c, d]) == [("a", "b"), ("b", "d")]
    queries = [Query("panel 'x' A", 'sum(rate(mlx_gateway_decode_tokens_total{model=~"$model"}[1m])) / '
                                    "sum(rate(mlx_gateway_decode_tokens_total[1m]))"),
               Query("panel 'y' A", 'sum by (model) (mlx_gateway_requests_waiting{ model =~ "$model" })'),
               Query("panel 'z' A", "mlx_gateway_build_info + mlx_gateway_mlx_memory_bytes"),
               Query("variable model", "mlx_gateway_requests_total")]
    labelled = {"mlx_gateway_decode_tokens_total", "mlx_gateway_requests_waiting", "mlx_gateway_build_info",
                "mlx_gateway_requests_total"}
    assert unfiltered(queries, labelled) == {"mlx_gateway_decode_tokens_total": ["panel 'x' A"]}


def test_metric_check_reports_unknown_names():
    """The check below can fail: a name that is not exposed is reported with its panel."""
    queries = [Query("panel 'x' A", 'sum(rate(mlx_gateway_bogus_total{tenant=~"$tenant"}[$__rate_interval]))'),
               Query("rule", "mlx_gateway:bogus:rate5m + mlx_gateway_decode_tokens_total")]
    exposed = {"mlx_gateway_decode_tokens_total"}
    assert missing_metrics(queries, exposed, set()) == {
        "mlx_gateway_bogus_total": ["panel 'x' A"], "mlx_gateway:bogus:rate5m": ["rule"]}
    assert missing_metrics(queries[1:], exposed, {"mlx_gateway:bogus:rate5m"}) == {}


def test_every_metric_of_dashboard_and_rules_is_exposed(tmp_path):
    overrides, keys = tenant_setup(tmp_path)
    overrides["prompt_cache_dir"] = str(tmp_path / "prompt-cache")  # the disk tier's metrics too
    with live_server(model_path("qwen3"), **overrides) as server:
        workload(server.url, keys)
        text = server.client().get("/metrics").text
    exposed = set(exposed_samples(text))
    rules = rule_queries()
    records = {q.where for q in rules if ":" in q.where}
    queries = [q for q in dashboard_queries(load_dashboard()) if exposed_on_this_platform(q)]
    missing = missing_metrics(queries + rules, exposed, records)
    assert not missing, "not in /metrics after a workload:\n" + "\n".join(
        f"  {name}: {', '.join(sorted(set(where)))}" for name, where in sorted(missing.items()))
    # Every series with a model label (the engine's, the caches', the models') is read
    # for the models the model variable selects.
    labelled = labelled_samples(text, "model")
    assert {"mlx_gateway_decode_tokens_total", "mlx_gateway_model_loaded"} <= labelled
    loose = unfiltered(queries, labelled)
    assert not loose, f"not filtered by {MODEL}:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in sorted(loose.items()))


def test_bundle_files_agree():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        image = svc["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: pin the image version ({image})"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / "deploy" / src).exists(), f"{name} mounts missing {src}"
    prom = services["prometheus"]
    assert "host.docker.internal:host-gateway" in prom["extra_hosts"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("."))
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/mlx-gateway.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["../grafana/dashboards"]
    assert (ROOT / "deploy" / "../grafana/dashboards" / DASHBOARD.name).exists()
    source = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"

    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    assert [(PROM_CONFIG.parent / f).resolve() for f in cfg["rule_files"]] == [RULES.resolve()]
    assert cfg["scrape_configs"][0]["static_configs"][0]["targets"] == ["host.docker.internal:8080"]


def test_service_files():
    plist = plistlib.loads((ROOT / "deploy/launchd/com.mlx-gateway.plist").read_bytes())
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True and plist["ThrottleInterval"] >= 5
    assert plist["ProgramArguments"][1] == "serve"
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("@HOME@/Library/Logs/")
    unit = (ROOT / "deploy/systemd/mlx-gateway.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert settings["Restart"] == "on-failure" and int(settings["RestartSec"]) > 0
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert settings["User"] == "mlx-gateway" and settings["StandardOutput"] == "journal"
    assert "MemoryDenyWriteExecute" not in settings and "PrivateDevices" not in settings
