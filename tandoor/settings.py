"""The one place where configuration is read from the environment (TANDOOR_*)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.events import MAX_REPLY_TOKENS
from schemas.topics import prompts_topic
from tandoor import PROJECT_ROOT
from tandoor.models import BUNDLED_MODELS, BUNDLED_PREFIX, ModelConfig, parse_models

MAX_USER_FILE_BYTES = 4 * 1024**3
Port = Annotated[int, Field(ge=0, le=65535)]  # 0: a free one (the ops and metrics ports)
# A server's port, which others must know: 0 opened none (redis-server) or an unknown one.
ServerPort = Annotated[int, Field(ge=1, le=65535)]
# TANDOOR_* variables that are not settings: the batch client's (`tandoor batch`), the
# set-up command's engine choice, and the tests' seeds.
OTHER_VARIABLES = frozenset(
    {
        "TANDOOR_API_KEY",
        "TANDOOR_API_URL",
        "TANDOOR_ENGINE",
        "TANDOOR_TEST_SEED",
        "TANDOOR_CHAOS_SEED",
    }
)


class Band(BaseModel):
    """A priority band: a contiguous range of partitions of every prompt topic."""

    name: str
    partitions: int = Field(ge=1)


class TierPolicy(BaseModel):
    """What a tier may use, and which priority band its prompts go to."""

    band: str
    requests_per_minute: int = Field(ge=1)
    tokens_per_minute: int = Field(ge=1)
    concurrent_streams: int = Field(ge=1)
    # A larger max_tokens is a 400 (at most MAX_REPLY_TOKENS, what any surface accepts).
    max_reply_tokens: int = Field(default=MAX_REPLY_TOKENS, ge=1, le=MAX_REPLY_TOKENS)
    # Redis unreachable: serve uncounted ("open") or refuse with a 503 ("closed").
    # See tandoor/policies/quota.py and docs/architecture.md "When Redis is down".
    redis_down: Literal["open", "closed"] = "closed"
    # How long a prompt may wait for a worker (None: queue_timeout_s). A prompt the
    # workers cannot start in time is refused at once: producers/gateway/shedding.py.
    max_wait_s: float | None = Field(default=None, gt=0)
    # Lines of a user's Batches API batches not yet answered, at most (None: what its
    # request quota runs in an hour). A tenant held back by its quota waits in
    # admission's buffer, and one that spread batches over every partition held every
    # other tenant's batches behind its own: producers/gateway/batches/enqueued.py.
    max_enqueued_batch_lines: int | None = Field(default=None, ge=1)

    @property
    def enqueued_batch_lines(self) -> int:
        return self.max_enqueued_batch_lines or self.requests_per_minute * 60


# The band admission feeds batch lines into, tenant by tenant (title and summary jobs
# go there too): interactive routes refuse tiers placed in it (routing.py).
BATCH_BAND = "batch"
DEFAULT_TIERS = {
    "free": TierPolicy(
        band="interactive-free",
        requests_per_minute=10,
        tokens_per_minute=20_000,
        concurrent_streams=1,
    ),
    "plus": TierPolicy(
        band="interactive-paid",
        redis_down="open",
        requests_per_minute=60,
        tokens_per_minute=200_000,
        concurrent_streams=4,
    ),
    "api": TierPolicy(
        band="interactive-paid",
        redis_down="open",
        requests_per_minute=600,
        tokens_per_minute=2_000_000,
        concurrent_streams=32,
    ),
    "batch": TierPolicy(
        band=BATCH_BAND,
        requests_per_minute=6_000,
        tokens_per_minute=10_000_000,
        concurrent_streams=256,
    ),
}


class Fallback(BaseModel):
    """Load shedding: while a model's backlog in a listed tier's band and the bands
    above it is at or past `backlog` prompts, that tier is answered by `model` instead."""

    model: str
    backlog: int = Field(ge=0)
    tiers: list[str]


DEFAULT_BANDS = [
    Band(name="interactive-paid", partitions=4),
    Band(name="interactive-free", partitions=4),
    Band(name=BATCH_BAND, partitions=4),
]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDOOR_")

    env: Literal["development", "test", "production"] = "development"
    # Servers' data, logs and pid files (git-ignored).
    home: Path = PROJECT_ROOT / ".tandoor" / "dev"
    # Downloaded server class paths; shared by every checkout on this machine.
    cache_dir: Path = Path.home() / ".cache" / "tandoor"

    host: str = "127.0.0.1"
    kafka_port: ServerPort = 9092
    kafka_controller_port: ServerPort = 9093
    kafka_heap: str = "512m"
    cassandra_port: ServerPort = 9042
    cassandra_storage_port: ServerPort = 7000
    cassandra_heap: str = "1G"  # -Xms is 256M: G1 grows only as needed
    # Not 6379: Debian's redis-server package (bootstrap installs it) starts a service
    # there, and a taken port stops the stack.
    redis_port: ServerPort = 6380
    start_timeout_s: float = 180.0

    keyspace: str = Field(default="tandoor", pattern=r"^[a-z][a-z0-9_]{0,47}$")  # CQL's rule
    cassandra_datacenter: str = "datacenter1"
    cassandra_replication_factor: int = Field(default=1, ge=1)  # the keyspace's
    kafka_replication_factor: int = Field(default=1, ge=1)  # every topic's, internal ones too
    # Served name -> how it is served: source, dtype, max_model_len (the context budget),
    # quantization, parallelism, slots, KV cache, template (tandoor/models.py).
    # By default the two bundled models: the main job serves both.
    models: dict[str, ModelConfig] = Field(
        default_factory=lambda: {
            name: ModelConfig(source=BUNDLED_PREFIX + name, display_name=shown)
            for name, shown in BUNDLED_MODELS.items()
        },
        min_length=1,
    )
    bands: list[Band] = DEFAULT_BANDS
    tiers: dict[str, TierPolicy] = DEFAULT_TIERS
    # Primary model -> its fallback; the backlog is checked every backlog_poll_s.
    fallbacks: dict[str, Fallback] = Field(default_factory=dict)
    backlog_poll_s: float = Field(default=1.0, gt=0)
    tokens_partitions: int = Field(default=8, ge=1)

    # Kafka latency knobs. Consumers keep fetch_min_bytes at 1, so a fetch returns as
    # soon as one record arrives: the wait only bounds empty long polls, and a short one
    # costs CPU (measured: 5 ms cut single-stream throughput by a quarter on 2 cores).
    fetch_wait_ms: int = Field(default=100, ge=0)
    producer_linger_ms: int = Field(default=1, ge=0)

    # Inference workers.
    # Slots (max_num_seqs), KV cache and dtype are the model's (`models`).
    worker_max_tokens: int = Field(default=40_000, ge=1)  # in-flight prompts + new tokens
    worker_grace_s: float = Field(default=20.0, ge=0)  # SIGTERM: finish, then hand back
    # A request's lease (workers/ledger.py): renewed while its worker holds it; once it
    # lapses (the worker died) another worker continues the reply.
    worker_lease_s: float = Field(default=10.0, ge=1)
    worker_band_reserve: float = Field(default=0.1, ge=0, le=1)  # share kept for lower bands
    # Share of a worker's slots only the top band may take, so a flood of lower bands
    # never makes a top-band prompt wait for a slot.
    worker_top_band_share: float = Field(default=0.25, ge=0, lt=1)
    # Each role's /metrics, /health and /ready (the streams app serves them on its web
    # port); 0 picks a free port, logged as "<role> metrics on http://...".
    worker_metrics_port: Port = 9400
    gateway_metrics_port: Port = 9401
    persist_metrics_port: Port = 9402
    log_format: Literal["text", "json"] = "text"  # json: one object per line
    # The HTTP gateway.
    gateway_port: ServerPort = 8000
    gateway_group: str = "gateway"  # replicas share `tokens` as one consumer group
    system_prompt: str | None = "You are a helpful assistant. Answer briefly."
    reply_max_tokens: int = Field(default=512, ge=1)
    queue_timeout_s: float = Field(default=120, gt=0)  # a reply not started by then fails
    # The worker answers an expired prompt itself; silence this much longer means no worker.
    no_worker_grace_s: float = Field(default=30, gt=0)
    # Per replica: open reply streams, and how long one write to a client may block
    # (a stuck client is cut off; it can resume with Last-Event-ID).
    gateway_max_streams: int = Field(default=1000, ge=1)
    gateway_resumes_per_user: int = Field(default=4, ge=1)  # open at once, per replica
    gateway_write_timeout_s: float = Field(default=30, gt=0)
    # At SIGTERM: how long streams that cannot resume (OpenAI API) may take to finish.
    gateway_drain_s: float = Field(default=30, ge=1)
    # At SIGTERM: how long the port stays open answering /ready with 503 before it
    # refuses connections (a load balancer's readiness probe sees the replica leave).
    gateway_unready_s: float = Field(default=2, ge=0)
    kafka_send_timeout_s: float = Field(default=5, gt=0)  # then 503, message marked failed
    # Request limits: a larger body is a 413; a larger head (request line and headers)
    # or more headers a 431.
    gateway_max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    gateway_max_file_bytes: int = Field(default=64 * 1024 * 1024, ge=1)  # POST /v1/files
    # What one user's uploads may hold in all; an upload beyond it is a 413.
    gateway_max_user_file_bytes: int = Field(default=MAX_USER_FILE_BYTES, ge=1)
    gateway_max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    gateway_max_headers: int = Field(default=100, ge=10)
    # Origins whose pages may call the API (CORS); none by default, so a browser lets
    # only the gateway's own chat page use it. E.g. '["https://chat.example.com"]'.
    cors_origins: list[str] = Field(default_factory=list)
    # Swagger UI (/docs) and ReDoc (/redoc) load their scripts from a CDN, on the origin
    # the chat page keeps its key on (sessionStorage survives navigating to /docs in the
    # same tab): off, only /openapi.json is served. On for development.
    gateway_api_docs: bool = True
    moderation_blocklist: list[str] = Field(default_factory=list)

    # The streams app (faust): its id names its group and internal topics.
    streams_app_id: str = "tandoor-streams"
    streams_web_port: Port = 6066  # rollups over HTTP
    # The usage records it rolls up (a benchmark points it at a topic of its own).
    streams_usage_topic: str = "usage"
    # The bearer token GET /rollups/... requires; unset, rollups are not served over HTTP
    # (they hold every user's usage). `tandoor run` makes one and prints it.
    analytics_token: str | None = Field(default=None, min_length=16)
    streams_retention_windows: int = Field(default=48, ge=1)  # kept per key and window size
    # A changed rollup goes to `usage.rollups` at most this often (and once when closed).
    streams_publish_s: float = Field(default=5.0, gt=0)
    # How long (in record time) a counted record's id is remembered, so a replay or a
    # second copy of it is not counted again.
    streams_dedupe_s: float = Field(default=600.0, gt=0)
    # A streams process that died (kill -9, a lost node) keeps its partitions this long
    # before the group moves them to the others; faust's own 60 s left them unserved for a
    # minute. It heartbeats every 3 s from a thread of its own, so 10 s is not flaky.
    streams_session_timeout_s: float = Field(default=10.0, ge=6)

    # The admission role: batch lines from `batch.requests` into the batch band.
    admission_group: str = "admission"
    admission_metrics_port: Port = 9403
    # Batch-band prompts each worker of a model may have queued or running (None: a
    # quarter of the model's max_num_seqs); beyond that lines wait in admission,
    # interleaved fairly between tenants, not in Kafka. Deeper keeps more of an engine
    # busy with batch work; shallower lets a newcomer's lines in sooner
    # (bench/batch_fairness.py: 1.9x its time alone at 8 of 32 slots, 3.0x at 32).
    batch_backlog_per_worker: int | None = Field(default=None, ge=1)
    # How tenants share the batch band: "vtc" interleaves them by tokens served
    # (producers/admission/fairness.py); "fifo" forwards lines in the order read (the
    # reference bench/batch_fairness.py compares with).
    admission_fairness: Literal["vtc", "fifo"] = "vtc"
    # Lines read ahead of forwarding (all tenants): each assigned partition of
    # `batch.requests` may fill its share, then it is paused until its lines move on.
    admission_max_waiting: int = Field(default=50_000, ge=1)
    # ... and in bytes of the lines as read (a waiting line takes about 1.3 times its
    # size in memory): long-context lines fill the memory long before 50,000 lines.
    admission_max_waiting_bytes: int = Field(default=256 * 1024 * 1024, ge=1)

    # Persistence consumer: its group on `tokens`.
    persist_group: str = "persist"

    # Each token event costs a Redis record, a produce, two fetches and an SSE write on
    # the engine's cores; the first word goes out token by token whatever the window
    # (workers/coalesce.py; measured in docs/benchmarks.md).
    coalesce_ms: float = Field(default=100.0, ge=0)
    coalesce_tokens: int = Field(default=16, ge=1)

    @field_validator("home", "cache_dir", mode="after")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        """Servers start in their own folders: a relative home named a folder inside each
        of them ("kafka exited during start-up")."""
        return path.expanduser().absolute()

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, raw: object) -> object:
        return parse_models(raw)

    @field_validator("models", mode="after")
    @classmethod
    def _topic_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:  # each names its prompt topic: "org/model" failed at bootstrap
            prompts_topic(name)
        return models

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if unknown := unknown_variables(os.environ):
            raise ValueError("; ".join(unknown))
        names = [band.name for band in self.bands]
        if len(set(names)) != len(names):
            raise ValueError(f"band names must be unique, got {names}")
        if clashes := self._shared_ports():
            raise ValueError(f"each port must be used once (0 picks a free one): {clashes}")
        for tier, policy in self.tiers.items():
            if policy.band not in names:
                raise ValueError(f"tier {tier!r} uses band {policy.band!r}; bands are {names}")
        for model, rule in self.fallbacks.items():
            unknown = [t for t in rule.tiers if t not in self.tiers]
            if model not in self.models or rule.model not in self.models or unknown:
                raise ValueError(
                    f"fallback {model!r} -> {rule.model!r} for {rule.tiers}: models must be "
                    f"served ({list(self.models)}) and tiers known ({sorted(self.tiers)})"
                )
        return self

    def _shared_ports(self) -> dict[int, list[str]]:
        """Ports two settings name (the main job runs every role and server on one host:
        the second to bind one failed at start, after the first had started)."""
        users: dict[int, list[str]] = {}
        for name in type(self).model_fields:
            if name.endswith("_port") and (port := getattr(self, name)):
                users.setdefault(port, []).append(name)
        return {port: names for port, names in users.items() if len(names) > 1}

    def kept_for_top(self, model: str) -> int:
        """Of each of the model's workers' slots, those only the top band may take."""
        return round(self.models[model].max_num_seqs * self.worker_top_band_share)

    def wait_budget_s(self, tier: str) -> float:
        """How long a prompt of `tier` may wait for a worker before it fails."""
        return self.tiers[tier].max_wait_s or self.queue_timeout_s

    def silence_limit_s(self, tier: str) -> float:
        """How long a reply may stay silent before no worker is assumed: its prompt's
        wait budget, then the grace in which a worker answers an expired prompt itself."""
        return self.wait_budget_s(tier) + self.no_worker_grace_s

    @property
    def served_models(self) -> list[str]:
        """The served names, the default (chat page, new conversations) first."""
        return list(self.models)

    @property
    def kafka_bootstrap(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A problem for each TANDOOR_* variable that names no setting (names are read as
    in any case, as pydantic-settings reads them): misspelt, it was ignored unsaid."""
    known = {f"TANDOOR_{name.upper()}" for name in Settings.model_fields}
    problems = []
    for name in sorted(n.upper() for n in environ if n.upper().startswith("TANDOOR_")):
        if name in known or name in OTHER_VARIABLES:
            continue
        if (whole := name.split("__")[0]) in known:  # read, it replaced the whole default
            problems.append(
                f"{name}: a part of a setting is not read alone; set {whole} as one JSON "
                "value (TANDOOR_MODELS__SMOLLM2__MAX_MODEL_LEN served smollm2 alone)"
            )
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        meant = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"{name}: no such setting{meant}")
    return problems


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
