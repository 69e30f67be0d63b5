"""The Kubernetes manifests (infra/k8s) against the Kubernetes schemas and the vendored
CRD schemas, offline, strictly (an unknown field is an error, as with kubectl's
strict field validation), and against the code they deploy: topics, group names,
settings, commands, labels."""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import typer
import yaml  # type: ignore[import-untyped]

from infra.topics import declared_topics
from producers.gateway.server import CANCELLED_REQUESTS_WAIT_S
from schemas import topics
from tandoor.cli import app
from tandoor.clients import TRANSACTION_TIMEOUT_MS
from tandoor.settings import Settings, unknown_variables
from tests.unit.k8s_manifests import (
    CRD_SCHEMAS,
    K8S,
    NOT_APPLIED_BY_KUSTOMIZE,
    Doc,
    all_docs,
    config_env,
    container_env,
    doc_id,
    errors,
    load,
    manifest_files,
    named,
    of_kind,
    pod_spec,
    port_names,
    role_settings,
    settings_from,
    structural_to_strict,
    tandoor_containers,
    worker_model,
    workloads,
)

# --- schema validation ---------------------------------------------------------------------


@pytest.mark.parametrize("doc", all_docs(), ids=doc_id)
def test_every_manifest_is_valid_against_its_schema(doc: Doc) -> None:
    assert errors(doc) == []


def test_every_kind_has_a_schema_here() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for d in all_docs()}
    custom = {k for k in kinds if "strimzi" in k[0] or "keda" in k[0]}
    assert custom == set(CRD_SCHEMAS), "vendor a schema for every custom resource we use"


def _first_container(doc: Doc) -> Doc:
    container: Doc = pod_spec(doc)["containers"][0]
    return container


BREAKAGES = [
    # (manifest, what is broken, how)
    (
        "Deployment/gateway",
        "misspelled container field",
        lambda d: _first_container(d).update({"imagePullPolicyy": "Always"}),
    ),
    (
        "Deployment/gateway",
        "port as a word",
        lambda d: _first_container(d)["ports"][0].update({"containerPort": "eight thousand"}),
    ),
    (
        "HorizontalPodAutoscaler/gateway",
        "misspelled spec field",
        lambda d: d["spec"].update({"maxReplica": 3}),
    ),
    ("KafkaTopic/tokens", "misspelled spec field", lambda d: d["spec"].update({"partition": 8})),
    ("KafkaTopic/tokens", "zero partitions", lambda d: d["spec"].update({"partitions": 0})),
    (
        "Kafka/tandoor",
        "listener field typo",
        lambda d: d["spec"]["kafka"]["listeners"][0].update({"tsl": True}),
    ),
    (
        "Kafka/tandoor",
        "unknown listener type",
        lambda d: d["spec"]["kafka"]["listeners"][0].update({"type": "internl"}),
    ),
    ("Kafka/tandoor", "no listeners", lambda d: d["spec"]["kafka"].pop("listeners")),
    ("KafkaNodePool/brokers", "unknown role", lambda d: d["spec"].update({"roles": ["worker"]})),
    (
        "ScaledObject/worker-llama-8b",
        "misspelled spec field",
        lambda d: d["spec"].update({"maxReplicas": 10}),
    ),
    ("ScaledObject/worker-llama-8b", "no triggers", lambda d: d["spec"].pop("triggers")),
    (
        "ScaledObject/worker-llama-8b",
        "metadata value not a string",
        lambda d: d["spec"]["triggers"][0]["metadata"].update({"lagThreshold": 200}),
    ),
    (
        "ScaledObject/worker-llama-8b",
        "bad label in metadata",
        lambda d: d["metadata"].update({"labels": {"tier": ["gpu"]}}),
    ),
]


@pytest.mark.parametrize(
    ("target", "what", "break_it"), BREAKAGES, ids=[f"{t}: {w}" for t, w, _ in BREAKAGES]
)
def test_a_broken_manifest_is_rejected(target: str, what: str, break_it: Any) -> None:
    kind, name = target.split("/")
    doc = copy.deepcopy(named(kind, name))
    assert errors(doc) == []
    break_it(doc)
    assert errors(doc), f"{target} with {what} was accepted"


def test_a_broken_copy_of_a_manifest_file_is_rejected(tmp_path: Path) -> None:
    broken = tmp_path / "gateway.yaml"
    broken.write_text((K8S / "gateway.yaml").read_text().replace("containerPort", "containerPrt"))
    found = [e for doc in load(broken) for e in errors(doc)]
    assert any("containerPrt" in e for e in found), found


# --- cross-references with the code -------------------------------------------------------


def test_kustomization_applies_every_manifest_but_the_bootstrap_job() -> None:
    with (K8S / "kustomization.yaml").open() as f:
        listed = set(yaml.safe_load(f)["resources"])
    assert listed == {p.name for p in manifest_files()} - NOT_APPLIED_BY_KUSTOMIZE


def test_every_declared_topic_has_a_matching_kafka_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = settings_from(config_env(), monkeypatch)
    manifests = {d["spec"]["topicName"]: d["spec"] for d in of_kind("KafkaTopic")}
    declared = declared_topics(settings)
    assert set(manifests) == {spec.name for spec in declared}
    for spec in declared:
        topic = manifests[spec.name]
        assert topic["partitions"] == spec.partitions, spec.name
        config = {k: str(v) for k, v in topic["config"].items()}
        assert {k: config.get(k) for k in spec.config} == spec.config, spec.name
        assert topic["replicas"] == spec.replication == settings.kafka_replication_factor == 3


def test_every_tandoor_setting_in_the_manifests_is_a_settings_field() -> None:
    keys = set(config_env())
    for _, container in tandoor_containers():
        keys |= set(container_env(container))
    unknown = {k for k in keys if not k.startswith("TANDOOR_")}
    unknown |= {k for k in keys if k.removeprefix("TANDOOR_").lower() not in Settings.model_fields}
    assert unknown == set()


def test_every_role_gets_settings_that_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    for _, container in tandoor_containers():
        settings = role_settings(container, monkeypatch)  # raises if any value is refused
        assert settings.env == "production"
        assert {"configMapRef": {"name": "tandoor-config"}} in container["envFrom"]


def test_no_role_is_given_the_namespaces_service_variables() -> None:
    """The kubelet writes each Service of the namespace into every pod's environment by
    default: Strimzi's `tandoor-kafka-bootstrap` as TANDOOR_KAFKA_BOOTSTRAP_SERVICE_HOST
    and the like, which the settings refuse as unknown, and every role exited at once."""
    kubelet_writes = {"TANDOOR_KAFKA_BOOTSTRAP_SERVICE_HOST": "10.0.0.5"}
    assert unknown_variables(kubelet_writes), "refused: the pods must not get them"
    for workload, _ in tandoor_containers():
        assert pod_spec(workload).get("enableServiceLinks") is False, doc_id(workload)


def test_every_role_runs_a_real_tandoor_command() -> None:
    commands: dict[str, Any] = getattr(typer.main.get_command(app), "commands", {})
    for workload, container in tandoor_containers():
        command = commands.get(container["command"][1])
        assert command is not None, f"{doc_id(workload)}: {shlex.join(container['command'])}"
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        given = {arg for arg in container["command"][2:] if arg.startswith("--")}
        assert given <= options, f"{doc_id(workload)}: unknown options {given - options}"


def test_keda_scales_workers_on_their_own_group_and_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = of_kind("ScaledObject")
    assert objects
    for scaled in objects:
        target = named("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        container = _first_container(target)
        model, settings = worker_model(container), role_settings(container, monkeypatch)
        (trigger,) = scaled["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka"
        assert model in settings.models
        assert meta["topic"] == topics.prompts_topic(model)
        assert meta["consumerGroup"] == topics.worker_group(model)
        kafka = of_kind("Kafka")[0]["metadata"]["name"]
        assert meta["bootstrapServers"].startswith(f"{kafka}-kafka-bootstrap.")
        # Every worker must hold partitions of every band (schemas/topics.py, intake.py).
        assert scaled["spec"]["maxReplicaCount"] <= min(b.partitions for b in settings.bands)
        # In-flight prompts count as lag: a threshold above the slots would never fire
        # before the average worker is full.
        assert int(meta["lagThreshold"]) <= settings.models[model].max_num_seqs


def test_workers_hold_a_gpu_and_drain_before_they_are_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = [(w, c) for w, c in tandoor_containers() if c["command"][1] == "worker"]
    assert workers
    for workload, container in workers:
        pod = pod_spec(workload)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        settings = role_settings(container, monkeypatch)
        # Drain: the grace period of in-flight prompts, then commit and engine shutdown.
        assert pod["terminationGracePeriodSeconds"] >= settings.worker_grace_s + 30
        metrics = {p["containerPort"] for p in container["ports"] if p["name"] == "metrics"}
        assert metrics == {settings.worker_metrics_port}


def test_every_role_has_probes_and_is_scraped_where_they_answer() -> None:
    for workload, container in tandoor_containers():
        if workload["kind"] == "Job":
            continue
        name, ports = doc_id(workload), {p["name"]: p["containerPort"] for p in container["ports"]}
        live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
        assert (live["path"], ready["path"]) == ("/health", "/ready"), name
        # One ops endpoint per role serves /metrics, /health and /ready (tandoor/ops.py).
        assert live["port"] == ready["port"] and live["port"] in ports, name
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == str(ports[live["port"]]), name


def test_every_scraped_pod_declares_the_port_it_is_scraped_on() -> None:
    """Cassandra's pods were annotated for a scrape on 7070, served by nothing there:
    a target always down, and its alert firing for good."""
    for workload in workloads():
        template = workload["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        declared = {
            str(port["containerPort"])
            for container in template["spec"]["containers"]
            for port in container.get("ports", [])
        }
        assert annotations["prometheus.io/port"] in declared, doc_id(workload)


def test_services_select_pods_that_exist_and_name_their_ports() -> None:
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        pods = [w for w in workloads() if _selects(selector, w)]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert all(target in port_names(w) for w in pods), (service, target)


def test_disruption_budgets_and_scalers_point_at_workloads() -> None:
    for budget in of_kind("PodDisruptionBudget"):
        assert any(_selects(budget["spec"]["selector"]["matchLabels"], w) for w in workloads())
    for hpa in of_kind("HorizontalPodAutoscaler"):
        named(hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
    for workload in workloads():
        if workload["kind"] != "Job":
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert _selects(workload["spec"]["selector"]["matchLabels"], workload), labels


def test_consumers_fit_the_partitions_they_share(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(config_env(), monkeypatch)
    partitions = {spec.name: spec.partitions for spec in declared_topics(settings)}
    # A gateway replica without a `tokens` partition cannot serve replies (unready), and
    # a rollout at the most replicas surges past them: at 10 % (69 over 690 of 696
    # partitions), the old pods could go 6 at a time, a rollout of ~115 steps.
    most = named("HorizontalPodAutoscaler", "gateway")["spec"]["maxReplicas"]
    surge = named("Deployment", "gateway")["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    surge = math.ceil(most * int(surge[:-1]) / 100) if isinstance(surge, str) else surge
    assert most + surge <= partitions[topics.TOKENS], (most, surge)
    assert named("Deployment", "persist")["spec"]["replicas"] <= partitions[topics.TOKENS]
    assert named("Deployment", "streams")["spec"]["replicas"] <= partitions[topics.USAGE]


def test_store_proxy_forwards_the_ports_the_settings_dial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = settings_from(config_env(), monkeypatch)
    config = named("ConfigMap", "store-proxy")["data"]["haproxy.cfg"]
    binds = {line.split()[1] for line in config.splitlines() if line.strip().startswith("bind")}
    ports = (settings.kafka_port, settings.cassandra_port, settings.redis_port)
    assert binds == {f"127.0.0.1:{port}" for port in ports}
    kafka = of_kind("Kafka")[0]["metadata"]["name"]
    assert f"{kafka}-kafka-bootstrap.tandoor.svc" in config
    for service in ("cassandra", "redis"):
        named("Service", service)
        assert f" {service}.tandoor.svc" in config
    for workload, _ in tandoor_containers():
        sidecars = pod_spec(workload).get("initContainers", [])
        assert [s["restartPolicy"] for s in sidecars if s["name"] == "store-proxy"] == ["Always"], (
            doc_id(workload)
        )


def _selects(selector: dict[str, str], workload: Doc) -> bool:
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


def test_strict_schemas_refuse_unknown_fields_but_keep_open_maps() -> None:
    schema = structural_to_strict(
        {
            "type": "object",
            "properties": {
                "config": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "size": {"x-kubernetes-int-or-string": True},
            },
        }
    )
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"config": {"any.thing": 1}, "size": "1Gi"})
    assert validator.is_valid({"size": 3})
    assert not validator.is_valid({"sise": 3})
    assert not validator.is_valid({"size": 1.5})
    json.dumps(schema)  # plain data: nothing left that jsonschema cannot read


CLOSE_S = 10  # a role's own close after its drain: producer flush, LeaveGroup, sessions


def test_each_roles_grace_period_covers_its_own_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's was 45 s for a 10 s preStop pause, 2 s unready and a 30 s drain:
    3 s left to close, and a replica killed before its LeaveGroup left its `tokens`
    partitions unread until the group's session timed out. Then 60 s, which left out the
    waits for the requests its drain cut: 8 s left to close."""
    for workload, container in tandoor_containers():
        pod, settings = pod_spec(workload), role_settings(container, monkeypatch)
        pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        role = container["command"][1]
        # The gateway's: unready, its drain, then the requests its drain cut (their
        # Redis releases) and their stops to Kafka, each waited for up to a limit.
        gateway = settings.gateway_unready_s + settings.gateway_drain_s
        gateway += CANCELLED_REQUESTS_WAIT_S + settings.kafka_send_timeout_s
        own = {"gateway": gateway, "worker": settings.worker_grace_s}.get(role, 0)
        needed = pause + own + CLOSE_S
        assert pod.get("terminationGracePeriodSeconds", 30) >= needed, (role, needed)  # k8s: 30


def test_brokers_cap_transactions_near_the_gateways_own() -> None:
    """An open transaction hides every later batch line of its partition from
    admission (read_committed): a client's left open held them for the broker's
    default cap, 15 minutes."""
    properties = (K8S.parent / "templates" / "kafka-server.properties").read_text()
    local = re.search(r"^transaction\.max\.timeout\.ms=(\d+)$", properties, re.MULTILINE)
    assert local, "the local broker sets no cap"
    (kafka,) = of_kind("Kafka")
    caps = [int(local[1]), kafka["spec"]["kafka"]["config"]["transaction.max.timeout.ms"]]
    for cap in caps:
        assert TRANSACTION_TIMEOUT_MS <= cap <= 5 * 60_000, caps
