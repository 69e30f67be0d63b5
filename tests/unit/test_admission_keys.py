"""Admission and the key of a waiting line, with stand-ins for its stores: revoked or
unreadable while the line waited, a key of no one's, and what its ops port says of
tenants (the real ones: tests/integration/test_batch_keys.py)."""

from __future__ import annotations

from typing import Any, cast
from unittest.mock import patch

from aiokafka.structs import ConsumerRecord
from cassandra.cluster import NoHostAvailable

from producers.admission.marks import CallerCache
from producers.admission.role import Admission
from schemas import topics
from tandoor.settings import Settings
from tests.unit.test_admission_forward import (
    Answers,
    MarkFailsOnce,
    Valid,
    forward_once,
)


class Revoked:
    async def resolve(self, key: str | None) -> None:
        return None  # the key was revoked while its line waited

    resolve_again = resolve


async def test_a_line_whose_key_was_revoked_while_it_waited_is_answered_401_not_run() -> None:
    """The key was checked once, when the line was read: lines held hours behind their
    tenant's quota ran (and were charged) under a key revoked meanwhile."""
    submitter, answers, prompt, admission = await forward_once(Revoked())
    assert submitter.sent == [], "it ran"
    (output,) = answers.sent
    assert output["response"]["status_code"] == 401 and output["custom_id"] == "line-0"
    assert admission.queued.where(prompt.request_id) is None


class KeyRevokedLater:
    """The key store: the key good when its line was read, revoked before it ran."""

    def __init__(self) -> None:
        self.revoked = False

    async def resolve(self, key: str) -> object | None:
        return None if self.revoked else object()


async def test_a_key_revoked_while_its_line_waited_is_not_taken_from_the_roles_cache() -> None:
    """The role kept each key 30 s on top of the key store's minute: a line forwarded
    in that time ran, and was charged, under the revoked key."""
    keys = KeyRevokedLater()
    callers = CallerCache(cast(Any, keys))
    assert await callers.resolve("tdr_key") is not None  # as the line was read
    keys.revoked = True
    submitter, answers, _, _ = await forward_once(callers)
    assert submitter.sent == [], "it ran"
    assert [output["response"]["status_code"] for output in answers.sent] == [401]


async def test_a_refusal_whose_mark_fails_is_sent_once() -> None:
    """The whole step was tried again, every second while Redis refused the mark (full):
    the same answer went out again and again."""
    _, answers, _, _ = await forward_once(Revoked(), MarkFailsOnce())
    assert len(answers.sent) == 1, answers.sent


class UnreadableFromNowOn:
    """The key store: the key good when its line was read, then Cassandra away."""

    def __init__(self) -> None:
        self.down = False

    async def resolve(self, key: str) -> object:
        if self.down:
            raise NoHostAvailable("Cassandra is unreachable", {})
        return object()


async def test_a_key_found_good_within_the_minute_is_not_stopped_by_cassandra_away() -> None:
    """Cassandra down (the key's Redis cache run out) just after the line was read: the
    key is as good as a revocation's minute allows, and the line runs."""
    keys = UnreadableFromNowOn()
    callers = CallerCache(cast(Any, keys))
    assert await callers.resolve("tdr_key") is not None  # as the line was read
    keys.down = True
    submitter, answers, prompt, _ = await forward_once(callers)
    assert submitter.sent == [prompt.request_id] and answers.sent == []


async def test_a_key_not_checked_within_the_minute_is_not_taken_on_trust() -> None:
    """A line read an hour ago, its key unreadable now: it ran, and was charged, under a
    key that may have been revoked since (the docs promise within a minute). It waits,
    put back in its tenant's queue, and nothing is answered for it."""
    keys = UnreadableFromNowOn()
    callers = CallerCache(cast(Any, keys))
    assert await callers.resolve("tdr_key") is not None
    keys.down = True
    with patch("producers.admission.marks.KEY_TRUSTED_S", 0.0):
        submitter, answers, prompt, admission = await forward_once(callers)
    assert submitter.sent == [] and answers.sent == [], "it ran or was answered"
    assert admission.queues[prompt.model].size == 1, "the line was dropped"
    assert admission.queued.where(prompt.request_id) == "0:3"


class NoOwner:
    async def resolve(self, key: str | None) -> None:
        return None

    resolve_again = resolve

    async def revoked_owner(self, key: str | None) -> None:
        return None  # never a key of anyone's


class RecordingMarks:
    def __init__(self) -> None:
        self.marked: list[str] = []

    async def where(self, request_id: str) -> str | None:
        return None

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        self.marked.append(position)


async def test_lines_with_no_ones_key_are_answered_but_leave_nothing_in_redis() -> None:
    """Anyone who can write to the topic, with no key at all, grew Redis by a mark kept
    7 days per line; under volatile-lru they pushed out quota windows and real marks."""
    admission = Admission(Settings())
    marks, answers = RecordingMarks(), Answers()
    admission.callers, admission.marks = cast(Any, NoOwner()), cast(Any, marks)
    admission.answers = cast(Any, answers)
    line = b'{"custom_id": "junk", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    junk = ConsumerRecord(
        topics.BATCH_REQUESTS, 0, 7, 0, 0, b"b1", line, None, 2, len(line), [("batch-id", b"b1")]
    )
    try:
        await admission._admit(junk, 0)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    (output,) = answers.sent
    assert output["response"]["status_code"] == 401 and output["custom_id"] == "junk"
    assert marks.marked == []


async def test_the_ops_port_counts_charged_tokens_per_model_and_names_no_tenant() -> None:
    """Ops ports carry no user data and no auth (docs/security.md): labelled by tenant,
    the counter named every batch user and their tokens (and one series each, without
    end); per-user usage is the rollups', behind their token."""
    _, _, prompt, admission = await forward_once(Valid())
    samples = [
        (sample.labels, sample.value)
        for metric in admission.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "tandoor_admission_charged_tokens_total"
    ]
    assert samples == [({"model": prompt.model}, 40)]


class RevokedOfKnownOwner:
    async def resolve(self, key: str | None) -> None:
        return None

    async def revoked_owner(self, key: str | None) -> str:
        return "u"


class TakenByAWorker(RecordingMarks):
    async def run_by_a_worker(self, request_id: str) -> bool:
        return True


async def test_a_line_read_again_after_a_worker_took_it_is_not_refused_for_its_revoked_key() -> (
    None
):
    """Forwarded, then admission died before marking it, and its key was revoked: read
    again, it was answered 401 while its first copy ran on in a worker and answered 200
    (two answers under one id). Its worker answers it; it is marked, and passed."""
    admission = Admission(Settings())
    marks, answers = TakenByAWorker(), Answers()
    admission.callers, admission.marks = cast(Any, RevokedOfKnownOwner()), cast(Any, marks)
    admission.answers = cast(Any, answers)
    line = b'{"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    headers = [("batch-id", b"b1"), ("authorization", b"Bearer tdr_revoked")]
    record = ConsumerRecord(
        topics.BATCH_REQUESTS, 0, 7, 0, 0, b"b1", line, None, 2, len(line), headers
    )
    try:
        await admission._admit(record, 0)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert answers.sent == [] and marks.marked == ["0:7"]
