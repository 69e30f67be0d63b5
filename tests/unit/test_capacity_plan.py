"""The capacity plan (bench/capacity_plan.py): its sizing meets the target and keeps
the invariants the design relies on, whatever figures are dropped in; the manifests
in infra/k8s carry its numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml  # type: ignore[import-untyped]

from bench.capacity_plan import (
    AUTOSCALE_HEADROOM,
    COALESCE_MS,
    Inputs,
    Plan,
    plan,
    table,
    worker_tokens_per_s,
)
from tandoor import PROJECT_ROOT

SCENARIOS = {
    "as documented": Inputs(),
    "default coalescing": replace(Inputs(), coalesce_ms=15.0),
    "slow GPU": replace(Inputs(), gpu_peak_tokens_per_s=3_000.0),
    "fast GPU": replace(Inputs(), gpu_peak_tokens_per_s=40_000.0, gpu_utilization=0.9),
    "small gateways": replace(Inputs(), gateway_streams_per_process=100),
    "long replies": replace(Inputs(), messages_per_s=10_000, tokens_per_s=8_000_000),
}


@pytest.fixture(params=list(SCENARIOS), ids=list(SCENARIOS))
def sized(request: pytest.FixtureRequest) -> Plan:
    return plan(SCENARIOS[request.param])


def test_workers_generate_the_target_tokens(sized: Plan) -> None:
    i = sized.inputs
    assert sized.workers * worker_tokens_per_s(i) >= i.tokens_per_s
    assert (sized.workers - 1) * worker_tokens_per_s(i) < i.tokens_per_s  # no idle GPUs
    assert sized.workers_max >= sized.workers * (1 + AUTOSCALE_HEADROOM) - 1


def test_every_band_is_at_least_as_wide_as_the_largest_worker_count(sized: Plan) -> None:
    assert sized.band_partitions >= sized.workers_max


def test_every_gateway_replica_owns_a_tokens_partition(sized: Plan) -> None:
    assert sized.tokens_partitions >= sized.gateway_max >= sized.gateway_replicas
    assert sized.tokens_partitions >= sized.persist_replicas


def test_gateways_hold_every_concurrent_stream(sized: Plan) -> None:
    per_replica = sized.inputs.gateway_streams_per_process
    assert sized.gateway_replicas * per_replica >= sized.concurrent_streams
    assert sized.gateway_replicas >= sized.gateway_cores  # one core a process


def test_coalescing_carries_every_token(sized: Plan) -> None:
    assert 1 <= sized.tokens_per_event <= sized.inputs.coalesce_tokens
    assert sized.token_events_per_s * sized.tokens_per_event == pytest.approx(
        sized.inputs.tokens_per_s
    )


def test_stores_are_whole_racks_with_room_for_replication(sized: Plan) -> None:
    assert sized.brokers % 3 == 0 and sized.brokers >= 3
    assert sized.cassandra_nodes % 3 == 0 and sized.cassandra_nodes >= 3
    assert sized.redis_shards >= 1
    assert sized.broker_disk_tb >= sized.broker_disk_tb_recommended > 0


def test_a_longer_coalescing_window_needs_fewer_events_and_brokers() -> None:
    fine, coarse = plan(replace(Inputs(), coalesce_ms=5.0)), plan(Inputs())
    assert coarse.token_events_per_s < fine.token_events_per_s
    assert coarse.brokers <= fine.brokers
    assert coarse.gateway_replicas <= fine.gateway_replicas


def test_encoded_events_are_measured_not_guessed() -> None:
    sizes = plan().sizes
    # A prompt carries its whole context; a final event the whole reply.
    assert sizes.prompt > sizes.final > sizes.usage
    assert sizes.final > sizes.token > 100


def test_the_table_names_every_resource() -> None:
    text = table(plan())
    for row in ("GPU workers", "partitions per band", "gateway replicas", "tokens partitions"):
        assert row in text
    for row in ("Kafka", "Cassandra", "Redis", "broker disk"):
        assert f"| {row}" in text


def test_the_manifests_are_sized_by_the_plan() -> None:
    sized = plan()
    docs = [
        doc
        for path in sorted((PROJECT_ROOT / "infra" / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] != "Kustomization"
    ]

    def spec(kind: str, name: str) -> dict[str, object]:
        (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return dict(found["spec"])

    (config,) = [d["data"] for d in docs if d["metadata"]["name"] == "tandoor-config"]
    bands = yaml.safe_load(config["TANDOOR_BANDS"])
    assert float(config["TANDOOR_COALESCE_MS"]) == COALESCE_MS
    assert [b["partitions"] for b in bands] == [sized.band_partitions] * len(bands)
    assert int(config["TANDOOR_TOKENS_PARTITIONS"]) == sized.tokens_partitions
    assert spec("ScaledObject", "worker-llama-8b")["maxReplicaCount"] == sized.workers_max
    assert spec("HorizontalPodAutoscaler", "gateway")["maxReplicas"] == sized.gateway_max
    assert spec("KafkaNodePool", "brokers")["replicas"] == sized.brokers
    assert spec("StatefulSet", "cassandra")["replicas"] == sized.cassandra_nodes
    assert spec("Deployment", "persist")["replicas"] == sized.persist_replicas
