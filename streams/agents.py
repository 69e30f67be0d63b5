"""The agents: what each record on `usage`, `tokens` and the by-model topic does to the
rollups. `usage` is keyed by user, so the per-user rollups are filled straight from it;
the per-model ones from the same records keyed by model (the by-model topic), where
re-runs counted from `tokens` (a worker died mid-reply) join them."""

from __future__ import annotations

import logging
from operator import methodcaller
from typing import TypeVar

import faust

from schemas.codec import SchemaError, decode, encode, is_final
from schemas.events import MAX_ID_CHARS, SERVICE_JOBS, Event, FinalEvent, UsageRecord
from streams.outputs import Outputs
from streams.rollups import counted_id, restart_keys, rollup_keys
from streams.tables import Counting, RollupTables, not_ahead

log = logging.getLogger(__name__)
E = TypeVar("E", bound=Event)
MAX_COUNT = 2**31  # tokens in one record: far past any model's context


def register_agents(
    app: faust.App,
    usage: faust.TopicT,
    tokens: faust.TopicT,
    by_model: faust.TopicT,
    rollups: RollupTables,
    out: Outputs,
) -> None:
    @app.agent(usage, name="rollups-by-user")
    async def by_user_agent(stream: faust.StreamT[bytes]) -> None:
        async for payload in stream:
            await on_usage(payload, rollups, out)

    @app.agent(tokens, name="restarts-from-tokens")
    async def restarts_agent(stream: faust.StreamT[bytes]) -> None:
        async for payload in stream:
            await on_token_event(payload, rollups, out)

    @app.agent(by_model, name="rollups-by-model")
    async def by_model_agent(stream: faust.StreamT[bytes]) -> None:
        async for payload in stream:
            await on_by_model(payload, rollups)


async def on_usage(payload: bytes, rollups: RollupTables, out: Outputs) -> None:
    """Count a finished request per user, pass it on keyed by model, settle its quota."""
    record = _plausible(_decoded(UsageRecord, payload, rollups), rollups)
    if record is not None:
        # A record whose id was marked before is passed on again: its copy may not
        # have got out then (a crash between the two); the per-model side knows it by
        # its id. One known by its offset was passed on when it was first read. A
        # title or summary is the model's work, not the user's request.
        if (
            record.kind in SERVICE_JOBS
            or await count(rollups, "user", record, counted_id(record)) != "replayed"
        ):
            await out.by_model(record.model.encode(), payload)
        await out.settle(record)


async def on_token_event(payload: bytes, rollups: RollupTables, out: Outputs) -> None:
    """Pass on the final events of re-runs (attempt > 1), without their text (the
    by-model topic is kept 30 days, `tokens` one); token events are skipped without
    being parsed."""
    if not is_final(payload):
        return
    final = _decoded(FinalEvent, payload, rollups)
    if final is not None and final.attempt > 1 and _ids_plausible(final, rollups):
        await out.by_model(final.model.encode(), encode(final.model_copy(update={"text": ""})))


async def on_by_model(payload: bytes, rollups: RollupTables) -> None:
    """A usage record or a re-run's final event, keyed by model."""
    if is_final(payload):
        final = _decoded(FinalEvent, payload, rollups)
        if final is not None:
            final = final.model_copy(update={"created_at_ms": not_ahead(final.created_at_ms)})
            at, keys = final.created_at_ms, restart_keys(final)
            apply = methodcaller("add_restart", final)
            # The token stream forwards these ahead of the usage it lags behind after an
            # outage: its times moving the model side on made the usage read late.
            await rollups.count("model", counted_id(final), at, keys, apply, advances=False)
        return
    record = _plausible(_decoded(UsageRecord, payload, rollups), rollups)
    if record is not None:  # forwarded again after a crash lost the user table's mark
        await count(rollups, "model", record, counted_id(record))


async def count(
    rollups: RollupTables, dimension: str, record: UsageRecord, record_id: bytes | None
) -> Counting:
    keys = [k for k in rollup_keys(record) if k[2] == dimension]
    apply = methodcaller("add", record)
    return await rollups.count(dimension, record_id, record.finished_at_ms, keys, apply)


def _plausible(record: UsageRecord | None, rollups: RollupTables) -> UsageRecord | None:
    """The record as counted: its time at most a little ahead of this clock (one far
    ahead made a window ending past 64 bits, and the app crashed at each publish, for
    good); None for counts no reply has (summed, they passed 64 bits, and no rollup of
    the user or model could be written for the rest of the window)."""
    if record is None or not _ids_plausible(record, rollups):
        return None
    counts = (record.prompt_tokens, record.completion_tokens, record.charged_tokens)
    if max(*counts, record.cached_tokens) >= MAX_COUNT:
        log.error("passing over usage record %s: token counts %s", record.request_id, counts)
        rollups.passed_over["implausible"] += 1
        return None
    return record.model_copy(update={"finished_at_ms": not_ahead(record.finished_at_ms)})


def _ids_plausible(record: UsageRecord | FinalEvent, rollups: RollupTables) -> bool:
    """Ids no worker writes (they refuse prompts with longer ones): a user id of 500 KB
    made a rollup past Kafka's record limit, and the failed send crashed the whole app."""
    ids = (record.request_id, record.user_id, record.model, record.tier)
    if max(map(len, ids)) <= MAX_ID_CHARS:
        return True
    log.error("passing over a record with an id of %d characters", max(map(len, ids)))
    rollups.passed_over["implausible"] += 1
    return False


def _decoded(model: type[E], payload: bytes, rollups: RollupTables) -> E | None:
    """The record, or None counted as passed over: a newer version rolled out before
    this app is lost to its rollups, and the metric says how much."""
    try:
        return decode(model, payload)
    except SchemaError as exc:
        log.error("skipping an undecodable %s: %s", model.__name__, exc)
        rollups.passed_over["undecodable"] += 1
        return None
