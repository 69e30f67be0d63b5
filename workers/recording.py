"""Each token event is recorded in the request's transcript, under its lease, before it
is published (workers/ledger.py): what a worker that takes the request over continues
from. Recording is also how a worker learns, at every event, that its lease is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from workers.attempt import Attempt, LeaseLost, Tracked
from workers.ledger import Recorded, RequestLedger

log = logging.getLogger(__name__)

LEASE_ASK_S = 1.0  # a prompt taken unleased asks for its lease again at most this often
FENCE_ASK_S = 1.0  # past its lease, with Redis out of reach, a reply asks this often


async def record(ledger: RequestLedger, attempt: Attempt, entry: Recorded) -> None:
    """The event goes to the transcript before Kafka, so the transcript holds at least
    what readers may have; once a record fails it holds less, and is dropped, at the
    next event again while Redis does not answer (the next attempt then restarts the
    reply). Every event asks whether the lease is still ours, recorded or not: a worker
    that lost it publishes nothing more."""
    request_id = attempt.prompt.request_id
    await lease_late(ledger, attempt, throttled=True)
    lease_asked = attempt.stale_transcript  # a drop asks too: one round trip an event
    if attempt.stale_transcript:
        await _forget_transcript(ledger, attempt)
    if not attempt.recording:
        if attempt.tracked.leased and not lease_asked:
            _stop_if_lost(attempt, await ledger.holds(request_id, attempt.number))
        return
    outcome = await ledger.record(request_id, attempt.number, entry)
    _stop_if_lost(attempt, outcome)
    if outcome != "ok":
        attempt.recording = False
        await _forget_transcript(ledger, attempt)


async def lease_late(ledger: RequestLedger, attempt: Attempt, throttled: bool) -> None:
    """Taken while Redis did not answer: lease it once Redis does (asked at most once a
    second while it does not), so that a worker the prompt is delivered to again waits
    for this one instead of running it too."""
    now = time.monotonic()
    if attempt.tracked.leased or (throttled and now - attempt.lease_asked < LEASE_ASK_S):
        return
    attempt.lease_asked = now
    taken = await ledger.lease_late(attempt.prompt.request_id)
    _stop_if_lost(attempt, taken)
    if taken == "ok":  # its records fail as a gap if some events went out unrecorded
        attempt.tracked.leased = attempt.recording = True


async def _forget_transcript(ledger: RequestLedger, attempt: Attempt) -> None:
    outcome = await ledger.forget_transcript(attempt.prompt.request_id, attempt.number, True)
    attempt.stale_transcript = outcome == "down"
    _stop_if_lost(attempt, outcome)


def _stop_if_lost(attempt: Attempt, outcome: str) -> None:
    if outcome == "lost":
        attempt.tracked.lost = True
        raise LeaseLost(attempt.prompt.request_id)


async def fenced(ledger: RequestLedger, attempt: Attempt) -> None:
    """Publish nothing past the lease while Redis cannot say it is still ours: cut off
    from a Redis that others reach, this worker published on beside the worker that took
    the request over, under the same sequence numbers with other text. Redis down for
    every worker, the reply waits until it is back (then takes its lapsed lease again)."""
    request_id, said = attempt.prompt.request_id, False
    while attempt.tracked.leased and ledger.leases.lapsed(request_id):
        outcome = await still_ours(ledger, attempt.tracked, attempt.number)
        _stop_if_lost(attempt, outcome)
        if outcome == "down":
            if not said:
                log.warning(
                    "%s: lease lapsed, Redis unreachable: held until it answers", request_id
                )
                said = True
            await asyncio.sleep(FENCE_ASK_S)


async def still_ours(
    ledger: RequestLedger, tracked: Tracked, attempt: int
) -> Literal["ok", "lost", "down"]:
    """Whether the lease is still ours (which renews it). A final not known to be
    recorded asks by sending its FINISH again: one that ran, its answer lost, left the
    request done, which the lease's own check, once it lapsed, takes for another
    worker's (the final never went out, the prompt was committed)."""
    final = tracked.unrecorded_final
    if final is None:
        return await ledger.holds(tracked.request_id, attempt)
    outcome = await ledger.finish(tracked.request_id, attempt, final)
    if outcome == "ok":
        tracked.unrecorded_final = None  # recorded: delivered as any recorded final
    return outcome


async def record_final_late(ledger: RequestLedger, attempt: Attempt) -> None:
    """A final that went out unrecorded, its usage record not (a stop, Kafka refusing
    it): recorded now if Redis answers, with the lease (given back next), so that the
    next worker delivers both, where it answered the prompt a second time."""
    request_id, final = attempt.prompt.request_id, attempt.tracked.unrecorded_final
    attempt.tracked.unrecorded_final = None  # the reply ends: no lease round sends it again
    if final and await ledger.finish(request_id, attempt.number, final) == "ok":
        attempt.tracked.leased = True
