"""How loaded each model's workers are, measured in the background every
`backlog_poll_s`, so admitting a prompt never waits on Kafka for it.

Per model: the backlog of each priority band (what its prompt partitions hold beyond
the worker group's commits: prompts waiting plus those being generated), how many
workers are in the group, and how fast the commits move (prompts finished per second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.topics import BandLayout, prompts_topic, worker_group
from tandoor.clients import group_members
from tandoor.settings import Settings

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # finish rate: commits over the last minute...
MIN_RATE_SPAN_S = 10.0  # ...once watched this long (a shorter look says too little)


@dataclass(frozen=True)
class ModelLoad:
    backlog: dict[str, int]  # band -> prompts past the workers' commits
    workers: int  # members of the model's worker group
    finished_per_s: float | None  # while they were full; None: not watched so long enough
    idle_s: float  # how long they have been full with nothing finishing (this replica saw)

    @property
    def total(self) -> int:
        return sum(self.backlog.values())

    def of(self, bands: list[str]) -> int:
        """Prompts of `bands`, waiting or being generated."""
        return sum(self.backlog.get(band, 0) for band in bands)

    def waiting(self, bands_ahead: list[str], slots: int, kept_for_top: int) -> int:
        """Prompts of `bands_ahead` (the top band first) beyond those the workers can be
        generating: the top band may hold every slot, the bands below it together only
        `slots - kept_for_top` of each worker's (counted as every slot, free prompts
        waited until they expired, and were never refused)."""
        top, *lower = bands_ahead
        top_backlog, lower_backlog = self.of([top]), self.of(lower)
        top_running = min(top_backlog, self.workers * slots)
        lower_running = min(
            lower_backlog, self.workers * (slots - kept_for_top), self.workers * slots - top_running
        )
        return top_backlog + lower_backlog - top_running - lower_running


@dataclass(frozen=True)
class Measured:
    backlog: dict[int, int]  # partition -> prompts past the commits
    done: int  # sum of the commits: moves by one per finished prompt
    workers: int


class Progress:
    """The commits of one model's workers over the last RATE_WINDOW_S, counted only while
    the workers were full: a rate measured while they had less to do than they could
    take says how much was asked, not how fast they finish (one reply in a quiet minute
    made a burst look six minutes long, and refused it)."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int, bool]] = deque()  # (when, commits, full)
        self._moved_at: float | None = None

    def add(self, now: float, done: int, *, full: bool) -> None:
        """`full`: every slot taken, so a new prompt waits for one to finish."""
        if not self._seen or self._seen[-1][1] != done or not full:
            # Moving, or room for more (nothing waits): not stalled. The first look
            # counts too: idle since watched.
            self._moved_at = now
        self._seen.append((now, done, full))
        while len(self._seen) > 2 and now - self._seen[1][0] >= RATE_WINDOW_S:
            self._seen.popleft()

    def rate(self) -> float | None:
        span = moved = 0.0
        for (then, done_then, full), (later, done_later, _) in pairwise(self._seen):
            if full:
                span, moved = span + later - then, moved + max(0, done_later - done_then)
        return moved / span if span >= MIN_RATE_SPAN_S else None

    def idle_s(self, now: float) -> float:
        return 0.0 if self._moved_at is None else now - self._moved_at


class LoadMonitor:
    """The latest load of every model this gateway serves."""

    def __init__(self, settings: Settings, poll_s: float | None = None) -> None:
        self.settings = settings
        self.poll_s = poll_s or settings.backlog_poll_s
        self.models = sorted(settings.models)
        self.layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
        self._load: dict[str, ModelLoad] = {}
        self._progress = {model: Progress() for model in self.models}
        self._task: asyncio.Task[None] | None = None

    def load(self, model: str) -> ModelLoad | None:
        """None until measured, or when Kafka could not be asked lately."""
        return self._load.get(model)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name="load-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        """Forever: a poll that ended would leave its last figures in force (a replica
        that saw no worker at its start would refuse every prompt from then on)."""
        while True:
            try:
                async with backlog_clients(self.settings) as (admin, offsets):
                    while True:
                        await self._measure_all(admin, offsets)
                        await asyncio.sleep(self.poll_s)
            except (KafkaError, OSError) as exc:
                for model in self.models:
                    self._unknown(model)
                log.warning("load monitor cannot reach Kafka (%r); retrying", exc)
                await asyncio.sleep(self.poll_s)

    async def _measure_all(self, admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer) -> None:
        for model in self.models:
            try:
                measured = await measure(admin, offsets, self.layout, model)
            except Exception as exc:  # a bug or an odd answer must not end the monitor
                self._unknown(model)
                expected = isinstance(exc, (KafkaError, OSError, KeyError))
                log.warning("load of %s unknown: %r", model, exc, exc_info=not expected)
                continue
            self.record(model, measured, time.monotonic())

    def _unknown(self, model: str) -> None:
        """Never refuse on stale figures; and watch anew once measured again (the gap
        paired with the last look before it read as minutes of nothing finished)."""
        self._load.pop(model, None)
        self._progress[model] = Progress()

    def record(self, model: str, measured: Measured, now: float) -> ModelLoad:
        """The model's load from a measurement taken at `now`, kept as its latest."""
        progress = self._progress[model]
        by_band = {band.name: 0 for band in self.layout.ranges}
        for partition, count in measured.backlog.items():
            by_band[self.layout.band_of(partition).name] += count
        seen = ModelLoad(by_band, measured.workers, None, 0.0)
        slots, kept = self.settings.models[model].max_num_seqs, self.settings.kept_for_top(model)
        full = seen.workers > 0 and seen.waiting(list(by_band), slots, kept) > 0
        progress.add(now, measured.done, full=full)
        load = ModelLoad(by_band, measured.workers, progress.rate(), progress.idle_s(now))
        self._load[model] = load
        return load


@asynccontextmanager
async def backlog_clients(
    settings: Settings,
) -> AsyncIterator[tuple[AIOKafkaAdminClient, AIOKafkaConsumer]]:
    """Both clients, each closed whatever happens, a start that failed included (the
    monitor retries through an outage: each retry left one open)."""
    async with contextlib.AsyncExitStack() as opened:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        opened.push_async_callback(admin.close)
        await admin.start()
        offsets = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False
        )
        opened.push_async_callback(offsets.stop)
        await offsets.start()
        yield admin, offsets


async def measure(
    admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer, layout: BandLayout, model: str
) -> Measured:
    backlog, done = await partition_backlog(admin, offsets, layout.total_partitions, model)
    return Measured(backlog, done, await group_members(admin, worker_group(model)))


async def partition_backlog(
    admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer, partitions: int, model: str
) -> tuple[dict[int, int], int]:
    """Prompts past the workers' commits per partition, and the sum of the commits."""
    tps = [TopicPartition(prompts_topic(model), p) for p in range(partitions)]
    ends = await offsets.end_offsets(tps)
    starts = await offsets.beginning_offsets(tps)
    committed = await admin.list_consumer_group_offsets(worker_group(model))
    backlog, done_total = {}, 0
    for tp in tps:
        done = max(committed[tp].offset if tp in committed else starts[tp], starts[tp])
        backlog[tp.partition] = max(0, ends[tp] - done)
        done_total += done
    return backlog, done_total


async def count_backlog(
    admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer, partitions: int, model: str
) -> int:
    """Prompts in the model's topic past its workers' commits."""
    return sum((await partition_backlog(admin, offsets, partitions, model))[0].values())
