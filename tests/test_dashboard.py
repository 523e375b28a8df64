"""The Grafana dashboard, the recording rules and the deploy bundle read only metrics a
live gateway exposes, and the bundle's files agree with each other."""

from __future__ import annotations

import plistlib
import re

import pytest
import yaml

from conftest import live_server, model_path
from gateway.engine_fault import EXIT_CODE
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
from redis_server import RedisServer, require_redis

ALL = {"instance": ".*", "tenant": ".*", "model": ".*"}  # every query variable of the dashboard
MODEL = 'model=~"$model"'
# Prometheus gives every scraped series an instance label (the target: one gateway replica).
INSTANCE = 'instance=~"$instance"'
# Series with a model label that the model variable must not filter: build_info's model
# is the first served model, not the model of the series.
NOT_PER_MODEL = {"mlx_gateway_build_info"}
# What the Models row shows: metric names its panels must read.
MODELS_ROW = {"mlx_gateway_model_loaded", "mlx_gateway_model_weights_bytes", "mlx_gateway_memory_budget_bytes",
              "mlx_gateway_prompt_cache_bytes", "mlx_gateway_model_unloads_total",
              "mlx_gateway_model_requests_in_flight"}
# What the Latency classes row shows, and its series whose priority label is a number
# (scheduler/metrics.py): their legends must name the class instead.
CLASSES_ROW = {"mlx_gateway_class_time_to_first_token_seconds_bucket", "mlx_gateway_inter_token_seconds_bucket",
               "mlx_gateway_requests_queued_by_class", "mlx_gateway_prefill_pauses_total",
               "mlx_gateway_prefill_resumes_total", "mlx_gateway_decode_holds_total", "mlx_gateway_decode_pauses_total",
               "mlx_gateway_origin_refused_total"}
NUMERIC_PRIORITY = {"mlx_gateway_requests_queued_by_class", "mlx_gateway_prefill_pauses_total",
                    "mlx_gateway_prefill_resumes_total", "mlx_gateway_decode_pauses_total"}
CLASS_NAMES = {"0": "interactive", "1": "standard", "2": "batch"}
# What the Cluster row shows, each by replica.
CLUSTER_ROW = {"mlx_gateway_prefix_cache_hits_tokens_total", "mlx_gateway_prefix_cache_queries_tokens_total",
               "mlx_gateway_requests_running", "mlx_gateway_decode_tokens_total", "mlx_gateway_requests_waiting",
               "mlx_gateway_limits_store_up"}
# What the Stored responses row shows (the Responses API's store), by tenant where the series has one.
STORE_ROW = {"mlx_gateway_responses_stored", "mlx_gateway_responses_stored_bytes",
             "mlx_gateway_responses_evictions_total", "mlx_gateway_responses_store_failures_total",
             "mlx_gateway_responses_torn_total"}


# What the LoRA adapters row shows (gateway/telemetry/lora_metrics.py).
LORA_ROW = {"mlx_gateway_lora_requests_total", "mlx_gateway_lora_completion_tokens_total",
            "mlx_gateway_lora_prompt_tokens_total", "mlx_gateway_lora_time_to_first_token_seconds_bucket",
            "mlx_gateway_lora_adapters_resident", "mlx_gateway_lora_adapter_bytes", "mlx_gateway_lora_loads_total"}


# What the Modalities row shows: images and embeddings.
MODALITIES_ROW = {"mlx_gateway_image_requests_total", "mlx_gateway_image_tokens_total",
                  "mlx_gateway_embedding_inputs_total", "mlx_gateway_embedding_tokens_total",
                  "mlx_gateway_images_refused_total"}


def missing_metrics(queries: list[Query], exposed: set[str], records: set[str]) -> dict[str, list[str]]:
    """Metric name -> where it is used, for names neither exposed nor recorded by a rule
    (recorded names contain ``:``)."""
    out: dict[str, list[str]] = {}
    for q in queries:
        for name in metric_names(substitute(q.expr, ALL)):
            if name not in (records if ":" in name else exposed):
                out.setdefault(name, []).append(q.where)
    return out


def unfiltered(queries: list[Query], labelled: set[str], matcher: str = MODEL,
               exempt: frozenset[str] = frozenset(NOT_PER_MODEL)) -> dict[str, list[str]]:
    """Metric name -> the panels where a selector of it, a name of ``labelled`` (series
    that carry the label of ``matcher``) not in ``exempt``, lacks ``matcher``: by default
    the ``model=~"$model"`` matcher of the model variable, on series with a model label."""
    out: dict[str, list[str]] = {}
    for q in queries:
        if not q.where.startswith("panel "):
            continue  # the variables' label_values queries list the values themselves
        for name in sorted(metric_names(q.expr) & labelled - exempt):
            if any(matcher not in m.replace(" ", "") for m in selectors(q.expr, name)):
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
    for name in ("instance", "tenant", "model"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
        assert "label_values(mlx_gateway_requests_total" in v["definition"], name
        assert v["definition"].replace(" ", "").endswith(f",{name})"), name
        assert v["datasource"]["uid"] == "${datasource}"
    # The tests substitute every variable (substitute() refuses one it has no value for).
    assert set(ALL) == {name for name, v in variables.items() if v["type"] == "query"}
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for title in ("Cache reuse", "Latency", "Throughput", "Tenants", "Models", "Latency classes", "Cluster",
                  "Stored responses", "Modalities", "LoRA adapters"):
        assert title in rows
    for title, names in (("Modalities", MODALITIES_ROW), ("LoRA adapters", LORA_ROW)):
        read = set().union(*(metric_names(t["expr"]) for p in row_panels(dash)[title] for t in p["targets"]))
        assert names <= read, names - read
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
    # Every series is read for the replicas the instance variable selects.
    queries = [q for q in dashboard_queries(dash) if q.where.startswith("panel ")]
    every = set().union(*(metric_names(q.expr) for q in queries))
    loose = unfiltered(queries, every, INSTANCE, frozenset())
    assert not loose, f"not filtered by {INSTANCE}: {loose}"
    check_classes_row(row_panels(dash)["Latency classes"])
    check_cluster_row(row_panels(dash)["Cluster"])
    check_store_row(row_panels(dash)["Stored responses"])


def check_store_row(panels: list[dict]) -> None:
    """The Stored responses row reads every store metric; a series with a tenant label is
    read for the tenants the tenant variable selects."""
    read = set().union(*(metric_names(t["expr"]) for p in panels for t in p["targets"]))
    assert STORE_ROW <= read, STORE_ROW - read
    per_tenant = {"mlx_gateway_responses_stored", "mlx_gateway_responses_stored_bytes",
                  "mlx_gateway_responses_evictions_total"}
    loose = unfiltered([Query(f"panel '{p['title']}'", t["expr"]) for p in panels for t in p["targets"]],
                       per_tenant, 'tenant=~"$tenant"', frozenset())
    assert not loose, f'not filtered by tenant=~"$tenant": {loose}'


def check_classes_row(panels: list[dict]) -> None:
    """The Latency classes row reads the class metrics; a series whose priority label is a
    number is drawn under its class's name (one target per class: the legend names the
    class of its ``priority="N"`` matcher, never ``{{priority}}``)."""
    assert len(panels) >= 5
    read = set().union(*(metric_names(t["expr"]) for p in panels for t in p["targets"]))
    assert CLASSES_ROW <= read, CLASSES_ROW - read
    for p in panels:
        for t in p["targets"]:
            for name in metric_names(t["expr"]) & NUMERIC_PRIORITY:
                for m in selectors(t["expr"], name):
                    c = re.search(r'priority\s*=\s*"(\d)"', m)
                    assert c, f"{p['title']}: select one class of {name}: {t['expr']}"
                    assert CLASS_NAMES[c.group(1)] in t["legendFormat"], (p["title"], t["legendFormat"])
                    assert "{{priority}}" not in t["legendFormat"], (p["title"], t["legendFormat"])


def check_cluster_row(panels: list[dict]) -> None:
    """The Cluster row reads per-replica figures: every target groups by instance, its
    legend names the instance, and every selector filters by the instance variable."""
    assert len(panels) >= 4
    read = set().union(*(metric_names(t["expr"]) for p in panels for t in p["targets"]))
    assert CLUSTER_ROW <= read, CLUSTER_ROW - read
    for p in panels:
        for t in p["targets"]:
            groupings = re.findall(r"\bby\s*\(([^)]*)\)", t["expr"])
            assert groupings and all("instance" in {g.strip() for g in by.split(",")} for by in groupings), \
                (p["title"], t["expr"])
            assert "{{instance}}" in t["legendFormat"], (p["title"], t["legendFormat"])
            for name in metric_names(t["expr"]):
                assert all(INSTANCE in m.replace(" ", "") for m in selectors(t["expr"], name)), (p["title"], name)


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
    assert unfiltered(queries, labelled, INSTANCE, frozenset()) == {
        name: [where] for name, where in [("mlx_gateway_build_info", "panel 'z' A"),
                                          ("mlx_gateway_decode_tokens_total", "panel 'x' A"),
                                          ("mlx_gateway_requests_waiting", "panel 'y' A")]}


def test_row_checks_report_class_numbers_and_missing_instances():
    """The rows' checks can fail: a numeric priority drawn as a number, or under another
    class's name; a Cluster target that does not group by instance or ignores the variable; a
    Stored responses row that misses a store metric or ignores the tenant variable."""
    def panel(expr, legend):
        return {"title": "p", "targets": [{"expr": expr, "legendFormat": legend}]}

    ok = [panel('histogram_quantile(0.95, sum by (le, priority) (rate(mlx_gateway_class_time_to_first_token'
                '_seconds_bucket[1m])))', "{{priority}}"),
          panel("mlx_gateway_inter_token_seconds_bucket", "x"),
          panel('sum(mlx_gateway_requests_queued_by_class{priority="0"})', "interactive"),
          panel('sum(rate(mlx_gateway_prefill_pauses_total{priority="2"}[1m])) + '
                'sum(rate(mlx_gateway_prefill_resumes_total{priority="2"}[1m]))', "batch"),
          panel("mlx_gateway_origin_refused_total", "{{tenant}}"),
          panel("sum(rate(mlx_gateway_decode_holds_total[1m]))", "holds"),
          panel('sum(rate(mlx_gateway_decode_pauses_total{priority="1"}[1m]))', "standard")]
    check_classes_row(ok)
    for bad in (panel("sum by (priority) (mlx_gateway_requests_queued_by_class)", "{{priority}}"),
                panel('sum(mlx_gateway_requests_queued_by_class{priority="1"})', "batch")):
        with pytest.raises(AssertionError):
            check_classes_row(ok + [bad])
    good = [panel(f'sum by (instance) ({n}{{{INSTANCE}}})', "{{instance}}") for n in sorted(CLUSTER_ROW)]
    check_cluster_row(good)
    for bad in (panel(f"sum({sorted(CLUSTER_ROW)[0]}{{{INSTANCE}}})", "{{instance}}"),
                panel(f"sum by (instance) ({sorted(CLUSTER_ROW)[0]})", "{{instance}}"),
                panel(f"sum by (instance) ({sorted(CLUSTER_ROW)[0]}{{{INSTANCE}}})", "all")):
        with pytest.raises(AssertionError):
            check_cluster_row(good + [bad])
    store = [panel(f'sum by (tenant) ({n}{{tenant=~"$tenant",{INSTANCE}}})', "{{tenant}}") for n in sorted(STORE_ROW)]
    check_store_row(store)
    for bad in (store[1:], store + [panel(f"sum(mlx_gateway_responses_stored{{{INSTANCE}}})", "all")]):
        with pytest.raises(AssertionError):
            check_store_row(bad)
    assert substitute(f'up{{{INSTANCE}}}', ALL) == 'up{instance=~".*"}'


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
    import mlx_lm
    from test_lora import write_mlx_lm

    adapter = write_mlx_lm(tmp_path / "tone", mlx_lm.load(str(model_path("qwen3")))[0], 1)
    overrides["lora_modules"] = [f"tone={adapter}"]  # the LoRA row's series (primed per served adapter)
    with RedisServer(require_redis()) as redis:  # mlx_gateway_limits_store_up: only with --limits-store
        with live_server(model_path("qwen3"), limits_store=redis.url, **overrides) as server:
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
    assert plist["ProgramArguments"][-2:] == ["--on-engine-fault", "exit"]  # exits with 75, which KeepAlive restarts
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("@HOME@/Library/Logs/")
    unit = (ROOT / "deploy/systemd/mlx-gateway.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert settings["Restart"] == "on-failure" and int(settings["RestartSec"]) > 0
    assert "--on-engine-fault exit" in unit and settings["RestartForceExitStatus"] == str(EXIT_CODE)
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert settings["User"] == "mlx-gateway" and settings["StandardOutput"] == "journal"
    assert "MemoryDenyWriteExecute" not in settings and "PrivateDevices" not in settings
