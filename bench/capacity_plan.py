"""Capacity plan for the target scale: partitions, GPU workers, gateway replicas, Kafka
brokers, Cassandra nodes and Redis shards, computed from named figures.

    python -m bench.capacity_plan

Every input is a named constant below, marked MEASURED (on this project's 2-CPU
machine), FROM bench/gateway_load.py (measured by its streams phase), or
ASSUMPTION (a public figure or a rule of thumb). Event sizes are measured by encoding
representative events with schemas.codec (bench/event_sizes.py, with its own
figures). docs/CAPACITY.md explains each line; change a figure here and rerun to get
the new table. The manifests in infra/k8s carry these numbers
(tests/unit/test_capacity_plan.py checks it): update them with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from bench.event_sizes import EventSizes, measure_sizes
from infra.topics import declared_topics
from schemas import topics
from tandoor.settings import Settings

# --- The product's scale target, beyond one machine (docs/CAPACITY.md) -------------------
TARGET_MESSAGES_PER_S = 35_000  # chat messages answered per second at peak
TARGET_TOKENS_PER_S = 5_800_000  # generated tokens per second, fleet-wide

# --- Measured on this project's 2-CPU machine (SmolLM2-135M on CPU, bench/*_vs_vllm.py) --
GATEWAY_VS_VLLM_TOKENS_PER_S = (536.9, 555.9)  # MEASURED: full path vs vLLM, 32 streams
WORKER_VS_VLLM = 1.003  # MEASURED: the worker alone reached 100.3% of vLLM at 32 streams
MEASURED_CPUS = 2

# --- From bench/gateway_load.py's streams phase ------------------------------------------
# MEASURED: one gateway process held 8,000 open streams (every one started, /health p50
# 0.36 ms) at 56.5 KiB and one fd each. The plan keeps the configured per-replica cap,
# TANDOOR_GATEWAY_MAX_STREAMS, well below what a process holds.
GATEWAY_STREAMS_PER_PROCESS = 1_000  # the configured cap (8,000 measured to hold)
GATEWAY_MEMORY_PER_STREAM_KIB = 56.5  # MEASURED
# ASSUMPTION until measured: CPU a gateway spends per message (auth, quota, Cassandra
# writes, context, produce); bench/gateway_load.py's sustained phase can give it.
GATEWAY_CPU_S_PER_REQUEST = 0.004

# --- GPU: never measured here (no GPU); a public figure, labelled ------------------------
# ASSUMPTION: vLLM serving Llama 3.1 8B (BF16) on one H100 80GB peaks at ~12,500 output
# tokens/s (third-party benchmarks collected at morphllm.com/vllm-benchmarks, 2026-04).
# An H200 is at least as fast (same compute, more memory bandwidth and KV room).
GPU_PEAK_TOKENS_PER_S = 12_500.0
GPU_UTILIZATION = 0.7  # ASSUMPTION: headroom so queues (and TTFT) stay short at peak
STREAM_DECODE_TOKENS_PER_S = 50.0  # ASSUMPTION: one reply's decode rate at that batch size
QUEUE_AND_PREFILL_S = 0.3  # ASSUMPTION: prompt produced to first token at peak
AUTOSCALE_HEADROOM = 0.25  # max replicas above the peak need: bursts, a lost zone
GATEWAY_UTILIZATION = 0.7  # HPA target: CPU and stream slots kept 30% free at peak

# --- Traffic shape -----------------------------------------------------------------------
# Production coalescing window (the ConfigMap's TANDOOR_COALESCE_MS; the default is 100 ms).
COALESCE_MS = 50.0

# --- Kafka -------------------------------------------------------------------------------
REPLICATION_FACTOR = 3
BROKER_APPENDS_PER_S = 400_000  # ASSUMPTION: replica appends/s a broker sustains
BROKER_BYTES_PER_S = 300e6  # ASSUMPTION: in + out per broker (NVMe, 25 GbE), with headroom
BROKER_PARTITION_REPLICAS = 4_000  # rule of thumb per broker
PARTITION_EVENTS_PER_S = 10_000  # ASSUMPTION: events/s one `tokens` partition carries well
TOKENS_READER_GROUPS = 3  # gateway fan-out, persist, streams (restart counter)
# Retention that fits the flow at scale (a prompt is dead after queue_timeout_s; a reply
# is resumed within minutes): docs/CAPACITY.md recommends it over infra/topics.py's.
RECOMMENDED_RETENTION_S = {"prompts": 6 * 3600, topics.TOKENS: 2 * 3600, topics.USAGE: 7 * 86400}

# --- Cassandra and Redis (per message; counted from the code paths) ----------------------
CASSANDRA_WRITES_PER_MESSAGE = (
    7  # user msg, conv updated_at, sidebar del+ins, reply, usage, last_reply
)
CASSANDRA_READS_PER_MESSAGE = 2  # ownership + summary row, history within the budget
CASSANDRA_NODE_WRITES_PER_S = 30_000  # ASSUMPTION: replica writes/s on an 8-core node
CASSANDRA_NODE_READS_PER_S = 15_000  # ASSUMPTION: LOCAL_QUORUM reads of small partitions
# Key cache, quota admit + settle, in-flight claim + release, the worker's arrival (lease,
# attempt, cancel check: one script), its final and its delivery + lease release.
REDIS_OPS_PER_MESSAGE = 9
# Besides: each token event is recorded in the request's transcript (one script), and
# each request in a worker renews its lease three times a lease (workers/ledger.py).
REDIS_OPS_PER_SHARD = 100_000  # ASSUMPTION: one primary with Lua scripts, with headroom
# Measured by bench.persist_memory: ~1,900 a second from one process on this 2-core
# machine, sharing its cores with Cassandra and Kafka (3 writes a final).
PERSIST_FINALS_PER_S_PER_PROCESS = 1_900


@dataclass(frozen=True)
class Inputs:
    messages_per_s: float = TARGET_MESSAGES_PER_S
    tokens_per_s: float = TARGET_TOKENS_PER_S
    gpu_peak_tokens_per_s: float = GPU_PEAK_TOKENS_PER_S
    gpu_utilization: float = GPU_UTILIZATION
    stream_decode_tokens_per_s: float = STREAM_DECODE_TOKENS_PER_S
    coalesce_ms: float = COALESCE_MS
    coalesce_tokens: int = field(default_factory=lambda: Settings().coalesce_tokens)
    gateway_streams_per_process: int = GATEWAY_STREAMS_PER_PROCESS
    bands: int = field(default_factory=lambda: len(Settings().bands))


@dataclass(frozen=True)
class Plan:
    inputs: Inputs
    sizes: EventSizes
    reply_tokens: float
    cpu_s_per_token_event: float
    tokens_per_event: int
    token_events_per_s: float
    workers: int
    workers_max: int
    band_partitions: int
    concurrent_streams: float
    gateway_cores: float
    gateway_replicas: int
    gateway_max: int
    gateway_memory_mib: float
    tokens_partitions: int
    kafka_ingress_bytes_per_s: float
    kafka_appends_per_s: float
    brokers: int
    broker_disk_tb: float  # per broker, with the retention infra/topics.py declares
    broker_disk_tb_recommended: float
    cassandra_nodes: int
    redis_shards: int
    redis_ops_per_s: float
    persist_replicas: int


def plan(inputs: Inputs | None = None) -> Plan:
    i = inputs or Inputs()
    reply_tokens = i.tokens_per_s / i.messages_per_s
    sizes = measure_sizes(reply_tokens, tokens_per_event(i))
    tpe = tokens_per_event(i)
    token_events = i.tokens_per_s / tpe
    workers = math.ceil(i.tokens_per_s / worker_tokens_per_s(i))
    workers_max = math.ceil(workers * (1 + AUTOSCALE_HEADROOM))
    streams = i.messages_per_s * (QUEUE_AND_PREFILL_S + reply_tokens / i.stream_decode_tokens_per_s)
    cores = token_events * cpu_per_token_event() + i.messages_per_s * GATEWAY_CPU_S_PER_REQUEST
    by_streams = streams / (i.gateway_streams_per_process * GATEWAY_UTILIZATION)
    gateways = math.ceil(max(by_streams, cores / GATEWAY_UTILIZATION))  # a core a process
    gateways_max = math.ceil(gateways * (1 + AUTOSCALE_HEADROOM))
    tokens_partitions = round_up(max(gateways_max, token_events / PARTITION_EVENTS_PER_S), 8)
    band_partitions = round_up(workers_max, 8)
    ingress, appends = kafka_load(i, sizes, token_events)
    return Plan(
        inputs=i,
        sizes=sizes,
        reply_tokens=reply_tokens,
        cpu_s_per_token_event=cpu_per_token_event(),
        tokens_per_event=tpe,
        token_events_per_s=token_events,
        workers=workers,
        workers_max=workers_max,
        band_partitions=band_partitions,
        concurrent_streams=streams,
        gateway_cores=cores,
        gateway_replicas=gateways,
        gateway_max=gateways_max,
        gateway_memory_mib=(streams / gateways) * GATEWAY_MEMORY_PER_STREAM_KIB / 1024,
        tokens_partitions=tokens_partitions,
        kafka_ingress_bytes_per_s=ingress,
        kafka_appends_per_s=appends,
        brokers=(
            brokers := brokers_needed(
                ingress, appends, band_partitions * i.bands + tokens_partitions
            )
        ),
        broker_disk_tb=disk_per_broker(
            topic_bytes(i, sizes, token_events), declared_retention(), brokers
        ),
        broker_disk_tb_recommended=disk_per_broker(
            topic_bytes(i, sizes, token_events), RECOMMENDED_RETENTION_S, brokers
        ),
        cassandra_nodes=cassandra_nodes(i.messages_per_s),
        redis_shards=math.ceil(redis_ops(i, token_events, streams) / REDIS_OPS_PER_SHARD),
        redis_ops_per_s=redis_ops(i, token_events, streams),
        persist_replicas=math.ceil(i.messages_per_s / PERSIST_FINALS_PER_S_PER_PROCESS),
    )


def redis_ops(i: Inputs, token_events_per_s: float, streams: float) -> float:
    renewals = streams * 3 / Settings().worker_lease_s
    return i.messages_per_s * REDIS_OPS_PER_MESSAGE + token_events_per_s + renewals


def worker_tokens_per_s(i: Inputs) -> float:
    """What one GPU worker is planned to generate: the public GPU figure, the headroom,
    and our measured worker-vs-vLLM ratio (capped at 1: never plan above the engine)."""
    return i.gpu_peak_tokens_per_s * i.gpu_utilization * min(1.0, WORKER_VS_VLLM)


def tokens_per_event(i: Inputs) -> int:
    """The coalescer sends the first token at once, then flushes on the first token that
    arrives a window after the last flush, or at coalesce_tokens (workers/coalesce.py)."""
    per_window = math.ceil(i.coalesce_ms / 1000 * i.stream_decode_tokens_per_s)
    return max(1, min(i.coalesce_tokens, per_window))


def cpu_per_token_event() -> float:
    """CPU seconds the pipeline adds per token event, derived from the measured loss of
    the full path against vLLM on a saturated 2-CPU machine (one token an event there).
    Rough and pessimistic: it includes the broker's work, which shared those CPUs."""
    ours, vllm = GATEWAY_VS_VLLM_TOKENS_PER_S
    return (1 - ours / vllm) * MEASURED_CPUS / ours


def kafka_load(i: Inputs, sizes: EventSizes, token_events: float) -> tuple[float, float]:
    """Bytes/s produced to the cluster and replica appends/s (records x RF)."""
    m = i.messages_per_s
    produced = m * (sizes.prompt + sizes.final + sizes.usage) + token_events * sizes.token
    records = m * 3 + token_events
    return produced, records * REPLICATION_FACTOR


def topic_bytes(i: Inputs, sizes: EventSizes, token_events: float) -> dict[str, float]:
    """Bytes/s written to each topic family (before replication)."""
    m = i.messages_per_s
    return {
        "prompts": m * sizes.prompt,
        topics.TOKENS: token_events * sizes.token + m * sizes.final,
        topics.USAGE: m * sizes.usage,
    }


def declared_retention() -> dict[str, float]:
    """Retention in seconds as infra/topics.py declares it (prompts.* share one)."""
    found: dict[str, float] = {}
    for spec in declared_topics(Settings()):
        family = "prompts" if spec.name.startswith(topics.PROMPTS_PREFIX) else spec.name
        found[family] = int(spec.config["retention.ms"]) / 1000
    return found


def disk_per_broker(
    written: dict[str, float], retention: Mapping[str, float], brokers: int
) -> float:
    stored = sum(rate * retention[family] for family, rate in written.items())
    return stored * REPLICATION_FACTOR / brokers / 1e12


def brokers_needed(ingress: float, appends: float, partitions: int) -> int:
    reads = ingress * TOKENS_READER_GROUPS  # the token stream dominates what is read
    by_bytes = (ingress * REPLICATION_FACTOR + reads) / BROKER_BYTES_PER_S
    by_appends = appends / BROKER_APPENDS_PER_S
    by_partitions = partitions * REPLICATION_FACTOR / BROKER_PARTITION_REPLICAS
    return round_up(max(by_bytes, by_appends, by_partitions, REPLICATION_FACTOR), 3)


def cassandra_nodes(messages_per_s: float) -> int:
    writes = messages_per_s * CASSANDRA_WRITES_PER_MESSAGE * REPLICATION_FACTOR
    reads = messages_per_s * CASSANDRA_READS_PER_MESSAGE * 2  # LOCAL_QUORUM of RF 3
    need = writes / CASSANDRA_NODE_WRITES_PER_S + reads / CASSANDRA_NODE_READS_PER_S
    return round_up(max(need, REPLICATION_FACTOR), 3)  # whole racks (three zones)


def round_up(value: float, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def table(p: Plan) -> str:
    i = p.inputs
    rows = [
        ("target", f"{i.messages_per_s:,.0f} messages/s, {i.tokens_per_s:,.0f} tokens/s"),
        ("reply length", f"{p.reply_tokens:.1f} tokens (target tokens / messages)"),
        (
            "encoded sizes (+overhead)",
            f"prompt {p.sizes.prompt} B, token {p.sizes.token} B, "
            f"final {p.sizes.final} B, usage {p.sizes.usage} B",
        ),
        (
            "per GPU worker",
            f"{worker_tokens_per_s(i):,.0f} tokens/s "
            f"({i.gpu_peak_tokens_per_s:,.0f} peak x {i.gpu_utilization} x worker/vLLM)",
        ),
        ("GPU workers", f"{p.workers} at peak, KEDA max {p.workers_max}"),
        (
            "partitions per band",
            f"{p.band_partitions} x {i.bands} bands "
            f"= {p.band_partitions * i.bands} per prompts topic",
        ),
        (
            "token events",
            f"{p.tokens_per_event} tokens/event (coalesce {i.coalesce_ms:g} ms), "
            f"{p.token_events_per_s:,.0f} events/s",
        ),
        ("concurrent streams", f"{p.concurrent_streams:,.0f}"),
        (
            "gateway CPU",
            f"{p.gateway_cores:,.0f} cores "
            f"({p.cpu_s_per_token_event * 1e6:.0f} us/token event + requests)",
        ),
        (
            "gateway replicas",
            f"{p.gateway_replicas} at peak, HPA max {p.gateway_max}, "
            f"~{p.gateway_memory_mib:,.0f} MiB of streams each",
        ),
        ("tokens partitions", f"{p.tokens_partitions}"),
        (
            "Kafka",
            f"{p.kafka_ingress_bytes_per_s / 1e6:,.0f} MB/s produced, "
            f"{p.kafka_appends_per_s:,.0f} replica appends/s -> {p.brokers} brokers",
        ),
        (
            "broker disk",
            f"{p.broker_disk_tb:,.1f} TB each with the declared retention, "
            f"{p.broker_disk_tb_recommended:,.1f} TB with the recommended one",
        ),
        (
            "Cassandra",
            f"{i.messages_per_s * CASSANDRA_WRITES_PER_MESSAGE:,.0f} writes/s "
            f"(RF {REPLICATION_FACTOR}) -> {p.cassandra_nodes} nodes",
        ),
        ("Redis", f"{p.redis_ops_per_s:,.0f} ops/s -> {p.redis_shards} shards (primaries)"),
        ("persist", f"{p.persist_replicas} replicas"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'what'.ljust(width)} | sizing |", f"| {'-' * width} | --- |"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main() -> None:
    print(table(plan()))
    print()
    slow = plan(replace(Inputs(), coalesce_ms=Settings().coalesce_ms))
    print(
        f"with the default coalesce window ({slow.inputs.coalesce_ms:g} ms): "
        f"{slow.token_events_per_s:,.0f} token events/s, {slow.brokers} brokers, "
        f"{slow.gateway_replicas} gateway replicas"
    )


if __name__ == "__main__":
    main()
