"""What infra/k8s/network-policy.yaml lets through, worked out from the manifests the
way the API server's NetworkPolicy semantics do: a pod selected by any policy takes
only what some rule of those policies allows, rules add up, and a named port is the
selected pod's containerPort of that name."""

from __future__ import annotations

from collections import defaultdict

from tests.unit.k8s_manifests import Doc, of_kind, pod_spec, workloads

Source = str  # "anyone", "namespace k=v" or "pods k=v"
ANYONE = "anyone"
MONITORING = "namespace kubernetes.io/metadata.name=monitoring"
ANALYTICS = "namespace tandoor.dev/analytics=true"
TANDOOR_PODS = "pods app.kubernetes.io/part-of=tandoor"
OPS_PORTS = {"worker": 9400, "gateway": 9401, "persist": 9402, "streams": 6066}


def labels(workload: Doc) -> dict[str, str]:
    found: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return found


def name(workload: Doc) -> str:
    return labels(workload)["app.kubernetes.io/name"]


def selects(selector: Doc, pod_labels: dict[str, str]) -> bool:
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist)."""
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values")
        present = key in pod_labels
        held = {
            "In": present and pod_labels[key] in (values or []),
            "NotIn": not present or pod_labels[key] not in (values or []),
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not held:
            return False
    return True


def container_ports(workload: Doc) -> dict[str, int]:
    pod = pod_spec(workload)
    containers = pod["containers"] + pod.get("initContainers", [])
    return {
        p.get("name", str(p["containerPort"])): p["containerPort"]
        for c in containers
        for p in c.get("ports", [])
    }


def peer(entry: Doc) -> Source:
    [(kind, selector)] = entry.items()  # one selector per peer in these manifests
    [(key, value)] = selector["matchLabels"].items()
    return f"{'namespace' if kind == 'namespaceSelector' else 'pods'} {key}={value}"


def rule_ports(rule: Doc, workload: Doc) -> set[int]:
    """The rule's ports that this pod has; every port of the pod when it names none."""
    ports = container_ports(workload)
    if "ports" not in rule:
        return set(ports.values())
    wanted = {p["port"] for p in rule["ports"]}
    return {number for port_name, number in ports.items() if {port_name, number} & wanted}


def reachable(extra: list[Doc] | None = None) -> dict[tuple[str, int], set[Source]]:
    """(pod name, port) -> who may connect, for every pod some policy selects."""
    allowed: dict[tuple[str, int], set[Source]] = defaultdict(set)
    for policy in of_kind("NetworkPolicy") + (extra or []):
        for workload in workloads():
            if not selects(policy["spec"]["podSelector"], labels(workload)):
                continue
            for port in container_ports(workload).values():
                allowed.setdefault((name(workload), port), set())
            for rule in policy["spec"].get("ingress", []):
                sources = {peer(p) for p in rule["from"]} if "from" in rule else {ANYONE}
                for port in rule_ports(rule, workload):
                    allowed[(name(workload), port)] |= sources
    return allowed


def test_everything_is_denied_unless_a_policy_allows_it() -> None:
    deny = [
        p
        for p in of_kind("NetworkPolicy")
        if p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"]
    ]
    assert deny and all("ingress" not in p["spec"] for p in deny)
    covered = {pod for pod, _ in reachable()}
    assert covered == {name(w) for w in workloads() if container_ports(w)}


def test_the_gateway_api_is_the_only_port_open_to_anyone() -> None:
    open_to_all = {key for key, sources in reachable().items() if ANYONE in sources}
    assert open_to_all == {("gateway", 8000)}


def test_ops_ports_answer_monitoring_alone() -> None:
    allowed = reachable()
    for role, port in OPS_PORTS.items():
        extra = {ANALYTICS} if role == "streams" else set()  # the rollups share its port
        assert allowed[(role, port)] == {MONITORING} | extra, role
    assert allowed[("redis", 9121)] == {MONITORING}  # the exporter


def test_the_stores_take_tandoor_pods_alone_and_every_role_is_one() -> None:
    allowed = reachable()
    assert allowed[("cassandra", 9042)] == {TANDOOR_PODS}
    assert allowed[("redis", 6379)] == {TANDOOR_PODS}
    assert allowed[("cassandra", 7000)] == {"pods app.kubernetes.io/name=cassandra"}
    for workload in workloads():  # else its store-proxy could not reach the stores
        assert labels(workload).get("app.kubernetes.io/part-of") == "tandoor", name(workload)


def test_every_declared_port_is_reachable_by_someone() -> None:
    """A policy that fenced off a port the system needs (gossip, a probe's port for
    the scraper) would show here as an empty set."""
    shut = [key for key, sources in reachable().items() if not sources]
    assert shut == []


def test_one_policy_too_wide_would_be_seen() -> None:
    """The checks above can fail: a rule without `from` on a store opens it to anyone."""
    wide: Doc = {
        "kind": "NetworkPolicy",
        "spec": {
            "podSelector": {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/name", "operator": "In", "values": ["redis"]}
                ]
            },
            "ingress": [{"ports": [{"port": "redis"}]}],
        },
    }
    allowed = reachable([wide])
    assert allowed[("redis", 6379)] == {TANDOOR_PODS, ANYONE}
    assert allowed[("redis", 9121)] == {MONITORING}
