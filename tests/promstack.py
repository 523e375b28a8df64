"""The monitoring bundle as data, and a real Prometheus to evaluate it against.

Shared by ``test_dashboard.py``, ``test_prometheus_e2e.py`` and
``benchmarks/render_dashboard.py``:

- the PromQL of the Grafana dashboard (panels and template variables) and of the
  recording rules, with Grafana's variables substituted;
- the metric names an expression reads, and the label matchers of each selector of one;
- the panels of each dashboard row;
- :class:`Prometheus`: the ``prometheus`` binary on a free loopback port, scraping one
  gateway with a config derived from ``deploy/prometheus/prometheus.yml``;
- :func:`workload`: requests that share a long prefix, so the prefix cache hits, in each
  latency class, and one from an Origin its key is not bound to.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "grafana" / "dashboards" / "mlx-gateway.json"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"


# ---------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Query:
    """One PromQL expression of the bundle. ``where`` names its panel, variable or rule;
    ``label`` is set for Grafana's ``label_values(selector, label)`` variable queries,
    whose ``expr`` is then the selector."""

    where: str
    expr: str
    label: Optional[str] = None


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def _panels(panels: list) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # rows hold their panels when collapsed


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


def dashboard_queries(dash: dict) -> list[Query]:
    """Every PromQL expression of ``dash``: panel targets and query variables."""
    out = []
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or var.get("definition", ""))
        m = _LABEL_VALUES.match(q)
        if m:
            out.append(Query(f"variable {var['name']}", m.group(1) or "", label=m.group(2)))
        else:
            out.append(Query(f"variable {var['name']}", q))
    for p in _panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append(Query(f"panel {p.get('title')!r} {t.get('refId', '')}", t["expr"]))
    return out


# prometheus-client's process collector reads /proc: these metrics exist on Linux only.
LINUX_ONLY = "mlx_gateway_process_"


def exposed_on_this_platform(q: Query) -> bool:
    """False for a query of a metric this platform does not expose (:data:`LINUX_ONLY`
    elsewhere than on Linux)."""
    return sys.platform.startswith("linux") or not any(n.startswith(LINUX_ONLY) for n in metric_names(q.expr))


def rule_queries(path: Path = RULES) -> list[Query]:
    """The recording (and alerting) rules of ``path``; ``where`` is the record or alert name."""
    doc = yaml.safe_load(path.read_text())
    return [Query(r.get("record") or r.get("alert"), r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def substitute(expr: str, values: dict[str, str], rate_interval: str = "1m") -> str:
    """``expr`` with Grafana variables replaced: ``$__rate_interval`` (and ``$__interval``,
    ``$__range``) by ``rate_interval``; ``$name``, ``${name}``, ``${name:fmt}`` and
    ``[[name]]`` by ``values[name]``."""
    for v in ("__rate_interval", "__interval", "__range"):
        expr = re.sub(r"\$\{%s\}|\$%s\b" % (v, v), rate_interval, expr)

    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for the variable {name!r} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", var, expr)


# Words that look like metric names but are PromQL syntax (aggregations take `by`
# before their parenthesis, so they are not recognised by the parenthesis alone).
_KEYWORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2", "inf", "nan", "Inf", "NaN",
}


def metric_names(expr: str) -> set[str]:
    """Metric names ``expr`` selects: string literals, label matchers, range and subquery
    brackets, grouping clauses, ``offset``/``@`` modifiers, numbers and function names
    stripped; a name inside ``{__name__="..."}`` counts too."""
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", s)
    s = re.sub(r"\boffset\s+-?[0-9a-z]+|@\s*\S+", " ", s)
    s = re.sub(r"(?<![\w:])[0-9][0-9.]*(?:[eE][+-]?[0-9]+)?", " ", s)
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def exposed_samples(text: str) -> dict[str, float]:
    """Sample name -> sum over its series, from Prometheus text format (``_total``,
    ``_bucket``, ``_sum``, ``_count`` and ``_created`` samples keep their suffixes)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def series_values(text: str, name: str, label: str, **match: str) -> dict[str, float]:
    """``label`` value -> value of the samples called ``name`` (summed over other labels),
    of the samples whose labels have the values of ``match`` only (e.g. ``model="chat"``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def labelled_samples(text: str, label: str) -> set[str]:
    """Names of the samples of Prometheus text ``text`` that carry ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples if label in s.labels}


def selectors(expr: str, name: str) -> list[str]:
    """The label matchers (``""`` for none) of each selector of the metric ``name`` in ``expr``."""
    return [m.group(1) or "" for m in re.finditer(
        r"(?<![\w:])%s(?![\w:])\s*(?:\{([^}]*)\})?" % re.escape(name), expr)]


def row_panels(dash: dict) -> dict[str, list[dict]]:
    """Row title -> the panels of that row: a collapsed row's own ``panels``, or the
    top-level panels laid out below it and above the next row (Grafana's layout)."""
    rows = sorted((p for p in dash["panels"] if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    out: dict[str, list[dict]] = {}
    for i, row in enumerate(rows):
        top = row["gridPos"]["y"]
        bottom = rows[i + 1]["gridPos"]["y"] if i + 1 < len(rows) else float("inf")
        out[row["title"]] = list(row.get("panels", [])) + [
            p for p in dash["panels"] if p["type"] != "row" and top < p["gridPos"]["y"] < bottom]
    return out


# ---------------------------------------------------------------------- Prometheus
PACKAGE_MANAGERS = ("apt-get", "dnf", "yum", "zypper", "pacman", "apk", "brew", "port")


def binaries() -> tuple[Optional[str], Optional[str]]:
    """Paths of ``prometheus`` and ``promtool`` on PATH (None where missing)."""
    return shutil.which("prometheus"), shutil.which("promtool")


def package_manager() -> Optional[str]:
    """The first package manager on PATH that could install Prometheus, or None."""
    return next((m for m in PACKAGE_MANAGERS if shutil.which(m)), None)


def stop_process(proc: Optional[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``grace`` seconds, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seconds(duration: str) -> float:
    """Seconds of a Prometheus duration such as ``1s``, ``500ms`` or ``1m``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    if not m:
        raise ValueError(f"not a duration: {duration!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def derived_config(target: str, interval: str = "1s", source: Path = PROM_CONFIG) -> dict:
    """The project's Prometheus config, scraping ``target`` ("host:port") every
    ``interval`` and evaluating rules as often; rule file paths made absolute. Everything
    else (job names, metrics path, rule files) stays as the project has it."""
    cfg = copy.deepcopy(yaml.safe_load(source.read_text()))
    glob = cfg.setdefault("global", {})
    glob.update(scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval)
    cfg["rule_files"] = [str((source.parent / f).resolve()) for f in cfg.get("rule_files", [])]
    for job in cfg["scrape_configs"]:
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
        for key in [k for k in job if k.endswith("_sd_configs")]:
            del job[key]
        job["static_configs"] = [{"targets": [target]}]
    return cfg


class Prometheus:
    """A ``prometheus`` process on a free loopback port with a temporary storage dir,
    scraping ``target`` with :func:`derived_config`. Use as a context manager: the
    process is always stopped (SIGTERM, then SIGKILL after 10 s) and the dir removed."""

    def __init__(self, target: str, interval: str = "1s", binary: str = "prometheus"):
        self.target, self.interval, self.binary = target, interval, binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self.pinned: Optional[float] = None  # see settle()

    def __enter__(self) -> "Prometheus":
        self._dir = tempfile.TemporaryDirectory(prefix="mlx-gateway-prom-")
        d = Path(self._dir.name)
        self.config_path = d / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(derived_config(self.target, self.interval)))
        self.log_path = d / "prometheus.log"
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={d / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            self._wait_ready(30)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ------------------------------------------------------------------ HTTP API
    def _get(self, path: str, **params) -> object:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list[dict]:
        """Instant query at ``at`` (default: the time :meth:`settle` pinned, else now); the
        result vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        at = self.pinned if at is None else at
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self._get("/api/v1/query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Range query; ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, selector: str = "") -> list[str]:
        params = {"match[]": selector} if selector else {}
        return self._get(f"/api/v1/label/{label}/values", **params)

    def targets_up(self) -> bool:
        active = self._get("/api/v1/targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def _rounds(self) -> dict[str, str]:
        """When each target was last scraped and each rule group last evaluated, as
        Prometheus reports it (a new value per scrape or evaluation)."""
        rounds = {f"scrape {t['scrapeUrl']}": t.get("lastScrape", "")
                  for t in self._get("/api/v1/targets")["activeTargets"]}
        for g in self._get("/api/v1/rules")["groups"]:
            rounds[f"rules {g['file']}:{g['name']}"] = g.get("lastEvaluation", "")
        return rounds

    def wait_rounds(self, n: int = 2, timeout: float = 15) -> None:
        """Wait until every target has been scraped, and every rule group evaluated, ``n``
        more times. Each round starts when the previous one has ended, so after ``n = 2``
        the rules have been evaluated after a scrape that followed this call."""
        deadline = time.monotonic() + timeout
        for i in range(n):
            before = self._rounds()
            while True:
                now = self._rounds()
                if all(now.get(k) != v for k, v in before.items()):
                    break
                if time.monotonic() > deadline:
                    stuck = sorted(k for k, v in before.items() if now.get(k) == v)
                    raise AssertionError(f"Prometheus finished {i} of {n} rounds of scrapes and rule "
                                         f"evaluations in {timeout} s; not done again: {stuck}")
                time.sleep(0.05)

    def settle(self, timeout: float = 15) -> float:
        """Pin instant queries (:meth:`query` without ``at``) to now, once the scrapes
        around now succeeded (the last one before it, the one before that and the first
        after it); return that time.

        Queries then read what a dashboard showed at that time, whatever the scrapes after
        it do: a gateway busy answering (its /metrics shares a process with the test's
        query threads) may miss a scrape's timeout, and the staleness markers of that failed
        scrape would hide its gauges from queries at later times. Rule groups evaluated
        before now (:meth:`wait_rounds`) have their series at the pinned time."""
        self.pinned = None
        window = 2.5 * _seconds(self.interval)
        deadline = time.monotonic() + timeout
        at = time.time()
        while True:
            stamps = [float(s["value"][1]) for s in self.query("timestamp(up)")]
            if stamps and min(stamps) > at:  # every target scraped since at, the scrape then included
                healthy = self.query(f"min_over_time(up[{int(window * 1000)}ms])", min(stamps))
                if healthy and all(float(s["value"][1]) == 1 for s in healthy):
                    self.pinned = at
                    return at
                at = time.time()  # a scrape failed: start again
            if time.monotonic() > deadline:
                raise AssertionError(f"no {window:g} s of successful scrapes of every target in {timeout} s:\n"
                                     f"{self.log()}")
            time.sleep(0.05)

    def wait_for(self, expr: str, want: float, timeout: float = 15) -> None:
        """Wait up to ``timeout`` seconds until ``expr`` (one series) equals ``want``: the
        gateway state ``want`` was read from has been scraped."""
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            res = self.query(expr)
            got = float(res[0]["value"][1]) if res else None
            if got == want:
                return
            time.sleep(0.2)
        raise AssertionError(f"{expr} is {got} in Prometheus, the gateway says {want}")


# ---------------------------------------------------------------------- workload
# Tenants of the monitoring tests: two that share nothing (alice's cache group has a
# byte quota; bob's requests are in the interactive latency class) and one limited to one
# request per minute, so that 429s are counted. alice's keys are bound to a browser
# extension's origin (programs, sending none, may use them too), so that a request from
# another origin is refused and counted.
EXTENSION_ORIGIN = "chrome-extension://mgwtestextensionabcdefghijklmnop"
TEST_TENANTS = {
    "alice": ("mgw-test-alice", f'cache_group = "alice"\ncache_bytes = "256M"\norigins = ["{EXTENSION_ORIGIN}"]\n'
                                "allow_no_origin = true\n"),
    "bob": ("mgw-test-bob", 'weight = 2.0\npriority = "interactive"\n'),
    "carol": ("mgw-test-carol", "requests_per_minute = 1\n"),
}
# An Origin no tenant is bound to.
FOREIGN_ORIGIN = "https://elsewhere.example"
# The admin key of the tenants file (no tenant's): loads and unloads models.
ADMIN_KEY = "mgw-test-admin"


def tenant_setup(tmp: Path) -> tuple[dict, list[Optional[str]]]:
    """ServeConfig overrides and API keys for :data:`TEST_TENANTS`, written as a tenants
    file in ``tmp`` with :data:`ADMIN_KEY` as its admin key; ``({}, [None])`` (the open
    default tenant, admin on loopback) for a gateway without ``--tenants``."""
    import hashlib

    from gateway.config import ServeConfig

    if "tenants" not in ServeConfig.__dataclass_fields__:
        return {}, [None]
    lines = [f'[admin]\nkey_sha256 = ["{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"]\n']
    for name, (key, extra) in TEST_TENANTS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines.append(f'[tenants.{name}]\nkey_sha256 = ["{digest}"]\n{extra}')
    path = tmp / "tenants.toml"
    path.write_text("\n".join(lines))
    return {"tenants": str(path)}, [key for key, _ in TEST_TENANTS.values()]


WORDS = ("the model cache token prompt server batch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water").split()


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + k * 3 + k * k) % len(WORDS)] for k in range(n))


async def _chat(c: httpx.AsyncClient, system: str, user: str, key: Optional[str], stream: bool) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 8, "temperature": 0, "stream": stream}
    if stream:
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code
    return (await c.post("/v1/chat/completions", json=body, headers=headers)).status_code


async def _workload(url: str, keys: list[Optional[str]], rounds: range, system_words: int) -> list[int]:
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        for r in rounds:
            for i, key in enumerate(keys):
                system = f"You are assistant {i}. " + words(system_words, i)
                # Cold or warm by round; then a concurrent burst that shares the system prompt.
                statuses.append(await _chat(c, system, "Question zero: " + words(20, 50), key, False))
                statuses += await asyncio.gather(*(
                    _chat(c, system, f"Question {j}: " + words(12 + j, 60 + j + r), key, j % 2 == 0)
                    for j in range(3)))
            headers = {"Authorization": f"Bearer {keys[0]}"} if keys[0] else {}
            statuses.append((await c.post("/v1/chat/completions", headers=headers, json={
                "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})).status_code)
            # A request asking for the batch class (below every tenant's), and one from an
            # Origin the first key is not bound to (a 403 where its tenant has origins).
            short = {"messages": [{"role": "user", "content": "Question batch: " + words(12, 90 + r)}],
                     "max_tokens": 8, "temperature": 0}
            statuses.append((await c.post("/v1/chat/completions", headers=headers,
                                          json={**short, "priority": "batch"})).status_code)
            statuses.append((await c.post("/v1/chat/completions", headers={**headers, "Origin": FOREIGN_ORIGIN},
                                          json=short)).status_code)
    return statuses


def workload(url: str, keys: Optional[list[Optional[str]]] = None, rounds: int = 1,
             system_words: int = 200, first_round: int = 0) -> list[int]:
    """Send chat requests to the gateway at ``url``: per API key in ``keys`` (None: no
    key, the default tenant), one request then three concurrent ones (two streaming)
    sharing a ``system_words``-word system prompt, ``rounds`` times; plus, each round, three
    requests of the first key: one for an unknown model (404), one in the batch latency class,
    one from :data:`FOREIGN_ORIGIN` (403 with :data:`TEST_TENANTS`). Round ``r``'s
    concurrent questions and batch-class request are its own; its first request repeats
    every round's (``first_round``: the first round's number). Returns the HTTP statuses."""
    return asyncio.run(_workload(url, keys or [None], range(first_round, first_round + rounds), system_words))
