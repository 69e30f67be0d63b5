"""Which failed writes count towards dead-lettering a final (consumers/write_refusals.py).
A refusal of every write was waited out afresh by each batch (one table's refusal held
up every reply each time), outage time counted as refusal time, and the wait outlasted
Kafka's poll limit (the consumer left its group; the next owner waited again)."""

from __future__ import annotations

from cassandra import InvalidRequest, Unauthorized
from cassandra.cluster import NoHostAvailable

from consumers.write_refusals import REFUSAL_WAIT_S, SLIP_GAP_S, RefusalClock

REVOKED = Unauthorized("User persist has no MODIFY permission on <table batch_outputs>")
DOWN = NoHostAvailable("Unable to complete the operation against any hosts", {})
POLL_LIMIT_S = 300.0  # aiokafka's max_poll_interval_ms: past it, the member leaves


def test_a_refusal_of_every_write_counts_only_past_the_wait() -> None:
    clock = RefusalClock()
    assert not clock.counts(REVOKED, 0.0)
    assert not clock.counts(REVOKED, REFUSAL_WAIT_S - 1)
    assert clock.counts(REVOKED, REFUSAL_WAIT_S)
    assert REFUSAL_WAIT_S + 3 * 5.0 < POLL_LIMIT_S  # then three rounds, 5 s apart at most


def test_a_later_batch_of_the_same_slip_counts_at_once() -> None:
    clock = RefusalClock()
    for at in range(0, int(REFUSAL_WAIT_S) + 1, 5):  # one batch's rounds, 5 s apart
        clock.counts(REVOKED, float(at))
    assert clock.counts(REVOKED, REFUSAL_WAIT_S + 30)  # the next batch: no wait again


def test_an_outage_or_a_long_quiet_starts_the_wait_again() -> None:
    clock = RefusalClock()
    clock.counts(REVOKED, 0.0)
    assert not clock.counts(DOWN, 10.0)  # waited out whatever it takes
    assert not clock.counts(REVOKED, REFUSAL_WAIT_S + 20)  # after the outage: a new wait
    assert not clock.counts(REVOKED, REFUSAL_WAIT_S + 20 + SLIP_GAP_S + 1)  # a new slip


def test_permissions_that_cannot_be_read_are_an_outage_and_a_poison_final_counts() -> None:
    clock = RefusalClock()
    unreadable = Unauthorized("Unable to perform authorization of permissions: timed out")
    assert not clock.counts(unreadable, 10 * REFUSAL_WAIT_S)
    too_long = InvalidRequest("Key length of 70000 is longer than maximum of 65535")
    assert clock.counts(too_long, 0.0)
