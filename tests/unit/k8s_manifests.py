"""The Kubernetes manifests (infra/k8s) as the tests read them: loaded, validated
strictly against the Kubernetes and vendored CRD schemas (offline), and the settings
and pods they describe."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from kubernetes_validate.utils import schema_contents  # type: ignore[import-untyped]
from referencing import Registry, Resource

from tandoor import PROJECT_ROOT
from tandoor.settings import Settings

K8S = PROJECT_ROOT / "infra" / "k8s"
SCHEMAS = K8S / "schemas"
KUBERNETES_VERSION = "1.33"  # checked against; native sidecars and preStop sleep need 1.30+
CRD_SCHEMAS = {
    ("kafka.strimzi.io/v1beta2", "Kafka"): "kafka.strimzi.io_v1beta2_kafka.yaml",
    ("kafka.strimzi.io/v1beta2", "KafkaNodePool"): "kafka.strimzi.io_v1beta2_kafkanodepool.yaml",
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"): "kafka.strimzi.io_v1beta2_kafkatopic.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.yaml",
}
NOT_APPLIED_BY_KUSTOMIZE = {"bootstrap-job.yaml"}  # runs after the topics exist
Doc = dict[str, Any]


# --- loading and validating ---------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[Doc]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


@cache
def all_docs() -> tuple[Doc, ...]:
    return tuple(doc for path in manifest_files() for doc in load(path))


def of_kind(kind: str) -> list[Doc]:
    return [doc for doc in all_docs() if doc["kind"] == kind]


def named(kind: str, name: str) -> Doc:
    found = [doc for doc in of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


@cache
def crd_validator(file: str) -> jsonschema.Draft202012Validator:
    with (SCHEMAS / file).open() as f:
        return jsonschema.Draft202012Validator(structural_to_strict(yaml.safe_load(f)))


def structural_to_strict(node: Any) -> Any:
    """A CRD's openAPIV3Schema as a JSON schema that refuses unknown fields, as the API
    server does under strict field validation (it prunes them otherwise)."""
    if isinstance(node, list):
        return [structural_to_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: structural_to_strict(value) for key, value in node.items()}
    if out.pop("x-kubernetes-int-or-string", False) and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def errors(doc: Doc) -> list[str]:
    """Every schema violation of one manifest document ([] when valid)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        found = [_describe(e) for e in crd_validator(CRD_SCHEMAS[key]).iter_errors(doc)]
        # The CRD schemas say only `metadata: object`; the API server checks ObjectMeta.
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
        return found + kubernetes_errors(meta)
    return kubernetes_errors(doc)


def kubernetes_errors(doc: Doc) -> list[str]:
    validator = kubernetes_validator(str(doc.get("apiVersion")), str(doc.get("kind")))
    if validator is None:
        return [f"no Kubernetes {KUBERNETES_VERSION} schema for {doc.get('kind')}"]
    return [_describe(error) for error in validator.iter_errors(doc)]


@cache
def kubernetes_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schemas (additionalProperties: false throughout),
    used directly so that every violation is reported, not only the first."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict"
    try:
        schema = schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", "")
    except FileNotFoundError:
        return None
    definitions = schema_contents(f"{folder}/_definitions.json", "")
    registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _describe(error: jsonschema.ValidationError) -> str:
    return f"{'.'.join(str(p) for p in error.absolute_path) or '$'}: {error.message}"


def doc_id(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# --- the settings and pods the manifests describe --------------------------------------------


def config_env() -> dict[str, str]:
    return {k: str(v) for k, v in named("ConfigMap", "tandoor-config")["data"].items()}


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("TANDOOR_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        return Settings()


def workloads() -> list[Doc]:
    return [d for d in all_docs() if d["kind"] in {"Deployment", "StatefulSet", "Job"}]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def tandoor_containers() -> Iterator[tuple[Doc, Doc]]:
    for workload in workloads():
        for container in pod_spec(workload)["containers"]:
            if container.get("command", [""])[0] == "tandoor":
                yield workload, container


def container_env(container: Doc) -> dict[str, str]:
    """The literal values (a Secret's are not in the manifests)."""
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def role_settings(container: Doc, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return settings_from({**config_env(), **container_env(container)}, monkeypatch)


def port_names(workload: Doc) -> set[str]:
    pod = pod_spec(workload)
    containers = pod["containers"] + pod.get("initContainers", [])
    return {p["name"] for c in containers for p in c.get("ports", []) if "name" in p}


def worker_model(container: Doc) -> str:
    args = container["command"]
    return str(args[args.index("--model") + 1])
