"""The Grafana dashboards (infra/k8s/grafana/dashboards): every metric a panel queries
is one some role exports, the panels operators need are there, and the Kubernetes
manifests provision every dashboard file."""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cache
from types import SimpleNamespace
from typing import Any, cast

import faust
import pytest
import yaml  # type: ignore[import-untyped]
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from consumers.metrics import PersistMetrics
from producers.admission.metrics import AdmissionMetrics
from producers.gateway.metrics import gateway_metrics
from producers.gateway.services import Services
from producers.gateway.streaming import StreamSlots
from streams.tables import RollupTables
from streams.web import metrics_registry
from tests.unit.k8s_manifests import K8S, Doc, named, pod_spec
from tests.unit.test_k8s_network_policy import reachable
from workers.metrics import WorkerMetrics

DASHBOARDS = K8S / "grafana" / "dashboards"
# What a Prometheus exposition of each family type holds (prometheus_client's names).
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2", "inf", "nan",
}  # fmt: skip
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
Panel = dict[str, Any]


# --- what the roles export ------------------------------------------------------------------


def _gateway_registry() -> CollectorRegistry:
    """With services up (some gauges are only there then) and the instrumentator's
    middleware built (it creates the HTTP metrics)."""
    load = SimpleNamespace(backlog={"batch": 1}, workers=1)
    deps = SimpleNamespace(
        chat=SimpleNamespace(deps=SimpleNamespace(fanout=SimpleNamespace(following=0))),
        load=SimpleNamespace(models=["m"], load=lambda model: load),
    )
    app = FastAPI()
    registry = gateway_metrics(app, StreamSlots(1), lambda: cast(Services, deps))
    app.build_middleware_stack()
    return registry


def _streams_registry() -> CollectorRegistry:
    tables = SimpleNamespace(sizes=lambda: {"rollups-by-user": 0}, passed_over=Counter())
    return metrics_registry(faust.App("dashboards-test"), cast(RollupTables, tables))


@cache
def exported() -> frozenset[str]:
    """Every series name some role serves on /metrics."""
    registries = [
        WorkerMetrics("m").registry,
        _gateway_registry(),
        PersistMetrics().registry,
        AdmissionMetrics().registry,
        _streams_registry(),
    ]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + s for s in SERIES_SUFFIXES.get(family.type, ("",))}
    return frozenset(names)


# --- what the dashboards query --------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a call,
    a keyword, or a label (in a {} matcher, or a by/on/... list)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", text)  # Grafana variables
    found = set()
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", text):
        called = text[match.end() :].lstrip().startswith("(")
        if not called and match.group() not in PROMQL_WORDS:
            found.add(match.group())
    return found


def grouped_by(expr: str) -> set[str]:
    return {
        label.strip()
        for keyword, labels in GROUPING.findall(expr)
        if keyword == "by"
        for label in labels.split(",")
    }


@cache
def dashboards() -> dict[str, Doc]:
    found = {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}
    assert found, f"no dashboard in {DASHBOARDS}"
    return found


def panels(dashboard: Doc) -> list[Panel]:
    """Every panel, those inside collapsed rows too."""
    out: list[Panel] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and variable query."""
    found = []
    for file, dashboard in dashboards().items():
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                found.append(
                    (f"{file}: panel {panel['title']!r} {target['refId']}", target["expr"])
                )
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                query = variable["query"]["query"]
                values = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
                assert values, f"{file}: variable {variable['name']}: {query}"
                found.append((f"{file}: variable {variable['name']!r}", values.group(1)))
    return found


# --- the tests ------------------------------------------------------------------------------


def test_the_extractor_finds_metrics_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (band, le) (rate(a_seconds_bucket{model=~"$model",'
        ' band!="x{y}"}[$__rate_interval]))) / on (model) group_left (tier) b_total offset 5m'
        " > bool 1e3 and sum(c) without (instance) or d:recorded"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c", "d:recorded"}
    assert grouped_by(expr) == {"band", "le"}


def test_every_queried_metric_is_exported_by_some_role() -> None:
    assert {"tandoor_worker_queue_seconds_bucket", "tandoor_gateway_open_streams"} <= exported()
    missing = {
        where: sorted(metric_names(expr) - exported())
        for where, expr in queries()
        if metric_names(expr) - exported()
    }
    assert missing == {}


def test_a_misspelt_metric_would_be_caught() -> None:
    expr = "sum by (model) (rate(tandoor_worker_generated_token_total[5m]))"
    assert metric_names(expr) - exported() == {"tandoor_worker_generated_token_total"}


def test_every_query_selects_some_metric() -> None:
    """Else the check above would pass a target the extractor cannot read."""
    assert [where for where, expr in queries() if not metric_names(expr)] == []


REQUIRED = [
    # (what operators look for, a metric the panel queries, the label it is grouped by)
    ("TTFT by band", "tandoor_worker_time_to_first_token_seconds_bucket", "band"),
    ("queue time by band", "tandoor_worker_queue_seconds_bucket", "band"),
    ("tokens per second by model", "tandoor_worker_generated_tokens_total", "model"),
    ("consumer lag by band", "tandoor_worker_consumer_lag", "band"),
    ("open streams per gateway", "tandoor_gateway_open_streams", "instance"),
    ("errors by reason: worker finals", "tandoor_worker_requests_finished_total", "reason"),
    ("errors by reason: gateway refusals", "tandoor_gateway_refused_requests_total", "reason"),
    ("errors by reason: busy refusals", "tandoor_gateway_busy_refusals_total", "reason"),
]


@pytest.mark.parametrize(("what", "metric", "label"), REQUIRED, ids=[r[0] for r in REQUIRED])
def test_the_panels_operators_need_are_there(what: str, metric: str, label: str) -> None:
    found = [
        where
        for where, expr in queries()
        if metric in metric_names(expr) and label in grouped_by(expr)
    ]
    assert found, f"no panel shows {what}: {metric} by {label}"


def test_quantiles_keep_the_buckets_apart() -> None:
    """histogram_quantile over a sum without `le` is a silent nonsense line."""
    for where, expr in queries():
        if "histogram_quantile" in expr:
            assert "le" in grouped_by(expr), where


def test_dashboards_are_importable_anywhere() -> None:
    uids = [d["uid"] for d in dashboards().values()]
    assert len(set(uids)) == len(uids) and all(uids)
    for file, dashboard in dashboards().items():
        assert dashboard["schemaVersion"] >= 39, file
        (datasource,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
        assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus"), file
        ids = [p["id"] for p in panels(dashboard)]
        assert len(set(ids)) == len(ids), file
        for panel in panels(dashboard):  # no data source uid of one Grafana baked in
            if panel["type"] != "row":
                sources = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
                assert all(s["uid"] == "${datasource}" for s in sources), panel["title"]


# --- provisioning --------------------------------------------------------------------------


def _kustomization() -> Doc:
    with (K8S / "kustomization.yaml").open() as f:
        doc: Doc = yaml.safe_load(f)
    return doc


def _generated(name: str) -> Doc:
    found: list[Doc] = [g for g in _kustomization()["configMapGenerator"] if g["name"] == name]
    assert len(found) == 1, f"expected one generated ConfigMap {name}"
    return found[0]


def test_the_kustomization_packs_every_dashboard() -> None:
    generator = _generated("grafana-dashboards")
    assert generator["namespace"] == "tandoor"
    files = {K8S / entry for entry in generator["files"]}
    assert files == set(DASHBOARDS.glob("*.json"))


def _mounts(workload: Doc) -> dict[str, str]:
    """ConfigMap name -> where the Grafana container sees it."""
    volumes = {
        v["name"]: v["configMap"]["name"] for v in pod_spec(workload)["volumes"] if "configMap" in v
    }
    [container] = pod_spec(workload)["containers"]
    return {
        volumes[m["name"]]: m["mountPath"]
        for m in container["volumeMounts"]
        if m["name"] in volumes
    }


def test_grafana_mounts_its_provisioning_and_the_dashboards() -> None:
    grafana = named("Deployment", "grafana")
    mounts = _mounts(grafana)
    assert mounts["grafana-datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["grafana-dashboard-provider"] == "/etc/grafana/provisioning/dashboards"
    provider_config = named("ConfigMap", "grafana-dashboard-provider")["data"]
    [provider] = yaml.safe_load(next(iter(provider_config.values())))["providers"]
    assert provider["options"]["path"] == mounts["grafana-dashboards"]
    [source] = yaml.safe_load(named("ConfigMap", "grafana-datasources")["data"]["prometheus.yaml"])[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    [container] = pod_spec(grafana)["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert source["url"] == "$PROMETHEUS_URL" and env["PROMETHEUS_URL"].startswith("http")
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", container["image"])


def test_grafana_is_reached_by_operators_alone() -> None:
    assert reachable()[("grafana", 3000)] == {"namespace tandoor.dev/operators=true"}
