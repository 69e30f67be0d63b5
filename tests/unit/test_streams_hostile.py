"""Records on `usage` that no worker should write but any Kafka client can (or a worker
with its clock gone wrong, or a replay long after): what the rollup agents make of
them, in faust's test context (no broker)."""

from __future__ import annotations

import faust
import pytest
from prometheus_client import generate_latest

from schemas.codec import encode
from schemas.events import now_ms
from streams.app import rollup_tables
from streams.tables import CLOCK_AHEAD_MS
from streams.web import metrics_registry, refusal
from tests.unit.test_streams_agents import Sink, count_per_model, short_memory, usage

__all__ = ["short_memory"]  # the fixture, used by name


async def test_a_record_stamped_past_64_bits_of_time_is_counted_now(
    short_memory: tuple[faust.App, Sink],
) -> None:
    """Its window ended past 64 bits: every publish of the rollups raised, and the app
    crashed, after every restart (the window came back from the changelog)."""
    app, sink = short_memory
    now = now_ms()
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("far", at=2**64 - 1)))
        await agent.put(encode(usage("near", at=now)))
    await count_per_model(app, sink)  # publishes: it raised here
    minutes = {k: r for k, r in sink.rollups.items() if k.startswith("user/ada/1m/")}
    assert sum(r["requests"] for r in minutes.values()) == 2, minutes
    assert max(r["end_ms"] for r in minutes.values()) <= now + CLOCK_AHEAD_MS + 120_000


async def test_token_counts_no_reply_has_are_passed_over_and_counting_goes_on(
    short_memory: tuple[faust.App, Sink],
) -> None:
    """Summed with the next record of the same user, 2**64 - 1 tokens made a rollup no
    one could write: each later record of the window raised out of the agent."""
    app, sink = short_memory
    now = now_ms()
    forged = usage("forged", at=now).model_copy(update={"prompt_tokens": 2**64 - 1})
    async with app.agents["rollups-by-user"].test_context() as agent:
        for record in (forged, usage("a", at=now), usage("b", at=now)):
            await agent.put(encode(record))
    await count_per_model(app, sink)
    minute = sink.rollups[f"user/ada/1m/{now // 60_000 * 60_000}"]
    assert (minute["requests"], minute["prompt_tokens"]) == (2, 6)
    assert sink.rollups[f"model/smollm2/1m/{now // 60_000 * 60_000}"]["requests"] == 2
    assert rollup_tables(app).passed_over["implausible"] == 1


@pytest.mark.parametrize("field", ["user_id", "model", "request_id"])
async def test_a_record_with_an_id_no_worker_writes_is_passed_over(
    short_memory: tuple[faust.App, Sink], field: str
) -> None:
    """A user id of 500 KB made a rollup (its key and its value) past Kafka's record
    limit: the failed send crashed the whole streams app."""
    app, sink = short_memory
    now = now_ms()
    forged = usage("forged", at=now).model_copy(update={field: "x" * 300})
    async with app.agents["rollups-by-user"].test_context() as agent:
        for record in (forged, usage("a", at=now)):
            await agent.put(encode(record))
    await count_per_model(app, sink)
    assert not [key for key in sink.rollups if "x" * 300 in key]
    assert sink.rollups[f"user/ada/1m/{now // 60_000 * 60_000}"]["requests"] == 1
    assert rollup_tables(app).passed_over["implausible"] == 1


async def test_a_record_for_a_window_already_closed_and_dropped_does_not_replace_it(
    short_memory: tuple[faust.App, Sink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Published closed with its final count, then dropped: a record for it read late (a
    replay, a catch-up) made it again with that one record, published closed as well:
    analytics reading the latest message per key saw 1 request instead of 30."""
    app, sink = short_memory
    tables = rollup_tables(app)
    hour = (now_ms() // 3_600_000 + 1) * 3_600_000
    monkeypatch.setattr("streams.tables.now_ms", lambda: hour + 10 * 60_000)
    async with app.agents["rollups-by-user"].test_context() as agent:
        for i in range(30):
            await agent.put(encode(usage(f"first-{i}", at=hour + i)))
        await tables.publish_changes()
        for minute in range(1, 11):  # stream time moves on: the first minute is dropped
            await agent.put(encode(usage(f"later-{minute}", at=hour + minute * 60_000)))
        await tables.publish_changes()
        final = sink.rollups[f"user/ada/1m/{hour}"]
        assert (final["requests"], final["closed"]) == (30, True)
        # Housekeeping runs at most once a second: publishing comes first, as in a replay.
        monkeypatch.setattr("streams.tables.HOUSEKEEP_EVERY_S", 3600.0)
        await agent.put(encode(usage("late", at=hour + 5)))
    await tables.publish_changes()
    assert sink.rollups[f"user/ada/1m/{hour}"] == final
    assert sink.rollups[f"user/ada/1h/{hour}"]["requests"] == 30 + 10 + 1  # still open
    assert tables.passed_over["late"] == 1


async def test_records_it_cannot_read_are_counted_as_passed_over_and_counting_goes_on(
    short_memory: tuple[faust.App, Sink],
) -> None:
    """A newer record version rolled out before the app (or bytes that are no record)
    was skipped with only a log line: analytics lost requests with no metric to say so."""
    app, sink = short_memory
    now = now_ms()
    newer = encode(usage("newer", at=now)).replace(b'"v":1', b'"v":99')
    async with app.agents["rollups-by-user"].test_context() as agent:
        for payload in (b"\xff not json", newer, encode(usage("a", at=now))):
            await agent.put(payload)
    async with app.agents["restarts-from-tokens"].test_context() as agent:
        await agent.put(b'{"type":"final","v":1,"request_id":7}')
    await count_per_model(app, sink)
    assert sink.rollups[f"user/ada/1m/{now // 60_000 * 60_000}"]["requests"] == 1
    assert rollup_tables(app).passed_over["undecodable"] == 3
    metrics = generate_latest(metrics_registry(app, rollup_tables(app))).decode()
    assert 'tandoor_streams_passed_over{reason="undecodable"} 3.0' in metrics


@pytest.mark.parametrize("token", ["analytics", "clé-analytique"])
def test_a_bearer_token_with_any_characters_is_refused_or_taken_not_a_500(token: str) -> None:
    """compare_digest raised TypeError on str with non-ASCII characters: a 500."""
    assert refusal(token, "Bearer été") is not None
    assert refusal(token, f"Bearer {token}") is None
