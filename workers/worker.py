"""The inference worker: prompts from Kafka into vLLM, token events back to Kafka."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from typing import Any

import orjson

from schemas.codec import SchemaError, decode
from schemas.events import MAX_ID_CHARS, ControlEvent, PromptRequest
from tandoor.background import Background
from tandoor.clients import REDIS_DOWN, kafka_producer, redis_client
from tandoor.logs import bind_request_id
from tandoor.ops import OpsServer
from tandoor.settings import Settings
from workers.attempt import Tracked
from workers.capacity import Capacity
from workers.control import ControlListener
from workers.engine import Engine, EngineOptions
from workers.intake import FULL_POLL_S, PromptIntake, Record
from workers.ledger import RequestLedger
from workers.metrics import WorkerMetrics
from workers.model_check import check_cache
from workers.prompt_limits import answerable, malformed_final, outlived_its_marks
from workers.publisher import Publisher
from workers.recording import still_ours
from workers.request import RequestRunner, RunnerConfig
from workers.slot import Slot

log = logging.getLogger(__name__)

COMMIT_INTERVAL_S = 0.1
ENGINE_STATS_S = 10.0
NOTING_S = 2.0  # at shutdown, for cancels still being noted in Redis (its read timeout)


class WorkerFailed(RuntimeError):
    """The worker cannot go on (engine or Kafka gone); its prompts go to another worker."""


class Worker:
    def __init__(self, settings: Settings, model: str, options: EngineOptions) -> None:
        """`options` from workers.model_check.prepare_engine, which checks the model."""
        self.settings = settings
        self.model = model
        self.options = options
        self.metrics = WorkerMetrics(model)
        bands = [band.name for band in settings.bands]
        self.capacity = Capacity(
            options.max_num_seqs, settings.worker_max_tokens, bands, settings.worker_top_band_share
        )
        self.intake = PromptIntake(settings, model)
        self.control = ControlListener(settings, self._on_cancel)
        self._redis = redis_client(settings)
        self._producer = kafka_producer(settings, client_id=f"worker.{model}")
        self._publisher = Publisher(self._producer)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ledger = RequestLedger(self._redis, owner, settings.worker_lease_s)
        self._engine: Engine | None = None
        self._runner: RequestRunner | None = None
        self._tracked: dict[str, Tracked] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._noting = Background()  # cancels noted in Redis for a copy yet to arrive
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._joined = False  # start() went as far as joining the group
        self._failure: BaseException | None = None
        self._resources = contextlib.AsyncExitStack()  # what start() opened, closed in reverse
        self.ops = OpsServer("worker", self.metrics.registry, self._readiness)

    async def start(self) -> None:
        # Its port first: taken, that is said at once, not after minutes of loading and
        # a join of the group (a rebalance for every worker of the model).
        await self.ops.start(self.settings.host, self.settings.worker_metrics_port)
        self._resources.push_async_callback(self.ops.close)
        self._resources.push_async_callback(self._redis.aclose)
        self._engine = await Engine.start(self.options)
        self._resources.push_async_callback(self._engine.shutdown)
        check_cache(self.model, self.settings.worker_max_tokens, self._engine.cache_tokens)
        if self._stopping.is_set():  # asked while loading: joining now is two rebalances
            log.info("worker for %s stopping before it joins its group", self.model)
            return
        await self._producer.start()
        self._resources.push_async_callback(self._producer.stop)
        config = RunnerConfig(
            self.model, self.settings.coalesce_ms / 1000, self.settings.coalesce_tokens
        )
        self._runner = RequestRunner(
            config,
            self._engine,
            self._publisher,
            self.ledger,
            self.capacity,
            self.metrics,
        )
        self._resources.push_async_callback(self._noting.finish, NOTING_S)  # after control's
        await self.control.start()
        self._resources.push_async_callback(self.control.stop)
        assert self.control.task is not None
        self._watch(self.control.task)
        await self.intake.start()
        self._resources.push_async_callback(self.intake.stop)
        self._joined = True
        log.info("worker for %s ready (%d slots)", self.model, self.capacity.max_seqs)

    async def run(self) -> None:
        """Take prompts until `request_stop`; then finish or hand back what is in flight."""
        if not self._joined:
            return  # stopped while starting: nothing taken, nothing to hand back
        loops = [
            self._watch(asyncio.create_task(self._commit_loop(), name="commit-loop")),
            self._watch(asyncio.create_task(self._renew_loop(), name="lease-renewal")),
            self._watch(asyncio.create_task(self._engine_stats_loop(), name="engine-stats")),
        ]
        try:
            await self._intake_loop()
        finally:
            await self._drain()
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
        if self._failure is not None:
            raise WorkerFailed(str(self._failure)) from self._failure

    def request_stop(self) -> None:
        """The first stop signal: finish what is in flight within the grace period. A
        second (Ctrl-C pressed again): hand it back now, as when the grace runs out."""
        if self._stopping.is_set():
            self._hurry.set()
        self._stopping.set()

    async def close(self) -> None:
        """Release what start() opened, in reverse order; safe to call twice."""
        await self._resources.aclose()

    async def _readiness(self) -> dict[str, bool]:
        return {
            "engine": self._engine is not None and self._engine.healthy,
            "kafka": bool(self.intake.consumer.assignment()),
            "accepting": not self._stopping.is_set(),
            "background": self._failure is None,
        }

    def _watch(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """A background task that ends by itself is a worker failure: unready, then
        the worker stops (exit non-zero) rather than go on without it."""
        task.add_done_callback(self._background_ended)
        return task

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        if self._stopping.is_set():  # on the way out: a failure is said, no more
            if (failure := task.exception()) is not None:
                name = task.get_name()
                log.warning("background task %s failed while stopping: %r", name, failure)
            return
        error = task.exception() or RuntimeError(f"{task.get_name()} ended")
        log.error("background task %s ended: %r; stopping", task.get_name(), error)
        self._failure = error
        self._stopping.set()

    async def _intake_loop(self) -> None:
        while not self._stopping.is_set():
            if self.capacity.free_for_new == 0:
                await self.intake.poll_while_full()
                self.metrics.lag(self.intake.backlog)
                await _first_of(
                    self.capacity.wait_for_free_seq(new=True),
                    self._stopping.wait(),
                    asyncio.sleep(FULL_POLL_S),
                )
                continue
            records = await self._take_into_free_slots()
            self.metrics.lag(self.intake.backlog)
            for record in records:
                task = asyncio.create_task(self._handle(record), name=f"prompt@{record.offset}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _take_into_free_slots(self) -> list[Record]:
        """Prompts for the free slots, held while they are fetched: a copy that took its
        slot back meanwhile made the engine hold more than max_num_seqs, and the one too
        many waited in vLLM's own queue, past the deadline checked before it."""
        free = self.capacity.free_for_new
        self.capacity.take_seq(free)
        records: list[Record] = []
        try:
            records = await self.intake.take(free)
        finally:
            if unused := free - len(records):
                await self.capacity.release_seq(unused)
        return records

    async def _handle(self, record: Record) -> None:
        slot = Slot(self.capacity, self.intake, record)
        try:
            try:
                prompt = answerable(decode(PromptRequest, record.value))
            except SchemaError as exc:
                await self._reject(record, exc)
            else:
                bind_request_id(prompt.request_id)
                if (original := self._tracked.get(prompt.request_id)) is not None:
                    # Fetched again while it runs here (a rebalance restarts even a kept
                    # partition from its oldest running prompt): no slot while it waits.
                    await slot.give_back()
                    await original.done.wait()
                # Answered here: known without asking Redis (down, the copy ran the whole
                # reply again and published a second, different final).
                if original is None or not original.delivered:
                    await self._run(prompt, self.intake.band_of(record), slot)
            # Not reached when handed back (cancelled).
            self.intake.finished(record, held=slot.held)
        except Exception as exc:
            log.exception("worker failure while handling offset %s", record.offset)
            self._failure = exc
            self._stopping.set()
        finally:
            if slot.held:
                await self.capacity.release_seq()

    async def _run(self, prompt: PromptRequest, band: str, slot: Slot) -> None:
        assert self._runner is not None
        if outlived_its_marks(prompt):
            log.warning(
                "%s: made over a day ago, past its deadline: passed over", prompt.request_id
            )
            return
        tracked = self._tracked.setdefault(prompt.request_id, Tracked(prompt.request_id))
        try:
            await self._runner.run(prompt, tracked, band, slot)
        finally:
            if self._tracked.get(prompt.request_id) is tracked:
                del self._tracked[prompt.request_id]
            tracked.done.set()

    async def _reject(self, record: Record, exc: SchemaError) -> None:
        """Undecodable prompt: dead-letter it, and answer if we can tell whom."""
        log.warning(
            "dead-lettering %s/%s@%s: %s", record.topic, record.partition, record.offset, exc
        )
        await self._publisher.dead_letter(record, str(exc))
        addressee = addressee_of(record.value)
        if addressee is not None:
            request_id, reply_partition = addressee
            final = malformed_final(request_id, self.model, str(exc))
            await self._publisher.final(final, reply_partition)
        self.metrics.finished("error")

    async def _on_cancel(self, event: ControlEvent) -> None:
        """Stopped here first, then noted for a copy yet to arrive, in the background:
        a slow Redis held each Stop up to its timeout behind the cancels before it (every
        worker sees every cancel), while the replies ran on."""
        tracked = self._tracked.get(event.request_id)
        if tracked is not None:
            tracked.cancelled = True
            if tracked.in_engine and self._engine is not None:
                await self._engine.abort(event.request_id)
            else:
                await self.capacity.wake()
            log.info("cancelled %s (%s)", event.request_id, event.reason or "no reason given")
        self._noting.start(self.ledger.mark_cancelled(event.request_id))

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            await self.intake.commit()

    async def _engine_stats_loop(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_STATS_S)
            if self._engine is not None:
                await self._engine.log_stats()

    async def _renew_loop(self) -> None:
        """Renew the leases of requests in hand; stop the ones another worker took."""
        while True:
            await asyncio.sleep(self.settings.worker_lease_s / 3)
            held = {
                t.request_id: t.attempt for t in self._tracked.values() if t.leased and not t.lost
            }
            for request_id in await self.ledger.renew(held):
                tracked = self._tracked.get(request_id)
                if tracked is None or await self._its_own_end(tracked):
                    continue
                log.warning("%s: lease lost to another worker; stopping it here", request_id)
                tracked.lost = True
                if tracked.in_engine and self._engine is not None:
                    await self._engine.abort(request_id)
                else:
                    await self.capacity.wake()
            await self.ledger.late_done.record()  # ends a Redis outage left unrecorded

    async def _its_own_end(self, tracked: Tracked) -> bool:
        """A lease found lapsed on a request done: where its final went out unrecorded,
        the done mark may be its own FINISH's, run while the answer was lost. Sent
        again, that final takes the lease back; Redis away, the reply's own check
        decides (`fenced`)."""
        if tracked.unrecorded_final is None:
            return False
        outcome = await still_ours(self.ledger, tracked, tracked.attempt)
        # Cleared meanwhile: the reply handed it to the late mark, which ran first.
        return outcome != "lost" or tracked.unrecorded_final is None

    async def _drain(self) -> None:
        """Give in-flight prompts the grace period, then hand back the rest uncommitted."""
        if self._tasks and await self._all_leasable():
            await self.intake.leave_for_others()
        if self._tasks:
            log.info(
                "finishing %d in-flight prompts (stop again to hand them back now)",
                len(self._tasks),
            )
            pending = await unfinished(set(self._tasks), self.settings.worker_grace_s, self._hurry)
            for task in pending:
                task.cancel()
            if pending:
                log.info("handing back %d prompts to other workers", len(pending))
                await asyncio.gather(*pending, return_exceptions=True)
        await self.ledger.late_done.record_all()  # what ended in a Redis outage, if back
        await self.intake.commit()

    async def _all_leasable(self) -> bool:
        """Every prompt in flight holds its lease, or will take it: another worker that
        fetches it again waits for this one. One run while Redis was down (no lease) it
        would run a second time."""
        if any(t.attempt and not t.leased for t in self._tracked.values()):
            return False
        try:
            return bool(await self._redis.ping())
        except REDIS_DOWN:
            return False


async def unfinished(
    tasks: set[asyncio.Task[None]], grace_s: float, hurry: asyncio.Event
) -> set[asyncio.Task[None]]:
    """The tasks still running once they all finish, `grace_s` passes or `hurry` is set."""
    if tasks:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_first_of(asyncio.wait(tasks), hurry.wait()), grace_s)
    return {task for task in tasks if not task.done()}


async def _first_of(*waits: Coroutine[Any, Any, Any]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def addressee_of(payload: bytes) -> tuple[str, int | None] | None:
    """The request id of a prompt that cannot be decoded, and the partition its gateway
    reads replies on (it keeps only those: an answer hashed elsewhere by its id was
    never seen, and the client waited out the silence limit)."""
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(payload)
        request_id = data.get("request_id") if isinstance(data, dict) else None
        # Longer than any prompt may hold: no gateway made it, and its answer was
        # too large to produce.
        if isinstance(request_id, str) and 0 < len(request_id) <= MAX_ID_CHARS:
            partition = data.get("reply_partition")
            valid = isinstance(partition, int) and not isinstance(partition, bool)
            return (request_id, partition if valid and partition >= 0 else None)
    return None
