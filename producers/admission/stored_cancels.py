"""Batch cancels as stored in Cassandra: the record a Redis restart does not lose.

A cancel over HTTP is stored on its batch's row, then marked in Redis, and admission and
the workers look only at the mark. Redis restarted empty (it keeps nothing on disk)
took the marks with it: a cancelled batch's waiting lines were forwarded, charged and
run, and the batch showed `cancelled` with most of its lines completed. Admission asks
the store about the batches whose lines wait and Redis knows no cancel of, each at most
every RECHECK_S, and puts back the marks it finds missing (LineMarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from cassandra.query import ValueSequence

from tandoor.clients import cql

RECHECK_S = 10.0  # a batch found not cancelled is asked about again after this
PER_QUERY = 100  # batch ids in one query (each its own partition)
REMEMBERED = 100_000  # batches found not cancelled, kept to spare their reads
SELECT_CANCELLED = "SELECT batch_id, user_id, cancelled_at FROM api_batches WHERE batch_id IN %s"

Batch = tuple[str, str]  # (owner, batch id)


class StoredCancels:
    def __init__(self, session: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self._clock = clock
        self._not_cancelled_at: dict[str, float] = {}  # batch id -> when found so

    async def cancelled(self, batches: Sequence[Batch]) -> set[Batch]:
        """Which of these were cancelled, by their stored rows (a batch of another owner,
        or of no row at all, as written to `batch.requests` by any Kafka client, is not).
        Raises what Cassandra raises."""
        now = self._clock()
        due = [
            b for b in batches if now - self._not_cancelled_at.get(b[1], -RECHECK_S) >= RECHECK_S
        ]
        found: set[Batch] = set()
        for start in range(0, len(due), PER_QUERY):
            chunk = due[start : start + PER_QUERY]
            ids = ValueSequence(sorted({batch_id for _, batch_id in chunk}))
            rows = await cql(self._session, SELECT_CANCELLED, (ids,))
            stored = {(row.user_id, row.batch_id) for row in rows if row.cancelled_at is not None}
            found |= stored & set(chunk)
        if len(self._not_cancelled_at) > REMEMBERED:
            self._not_cancelled_at.clear()
        for _, batch_id in set(due) - found:
            self._not_cancelled_at[batch_id] = now
        return found
