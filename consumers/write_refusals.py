"""Which failed writes of a final count towards dead-lettering it.

Cassandra out of reach or overloaded is waited out, whatever it takes (the next owner
replays if this one leaves the group). A refusal whatever the write holds (a grant
revoked, a table or keyspace missing mid-restore: an operator's slip) dead-lettered
every reply of it in 0.3 s; it is waited out for REFUSAL_WAIT_S, then counted. Not for
good: it may be one table's (a batch line's), holding up every other reply, and past
Kafka's poll limit (5 minutes) the consumer left its group and the next owner waited
again. Anything else is the final's own."""

from __future__ import annotations

import re

from cassandra import InvalidRequest, Unauthorized
from cassandra.connection import ConnectionException

from tandoor.clients import CASSANDRA_DOWN

UNAVAILABLE = (*CASSANDRA_DOWN, ConnectionException)
REFUSAL_WAIT_S = 60.0
SLIP_GAP_S = 60.0  # refusals further apart are separate slips, each waited out
# Cassandra 4's words, then 5's (and Scylla's), for a table or keyspace not there.
_SCHEMA_MISSING = re.compile(
    r"unconfigured table|(?:keyspace|table) '?\S+'? does not exist", re.IGNORECASE
)
# Permissions that could not be read (system_auth's replicas down): an outage.
_AUTH_UNREADABLE = "Unable to perform authorization"


def unavailable(error: BaseException) -> bool:
    return isinstance(error, UNAVAILABLE) or (
        isinstance(error, Unauthorized) and _AUTH_UNREADABLE in str(error)
    )


def refusing_all(error: BaseException) -> bool:
    """A refusal whatever the write holds: a grant revoked, a table or keyspace missing."""
    if isinstance(error, Unauthorized):
        return True
    return isinstance(error, InvalidRequest) and bool(_SCHEMA_MISSING.search(str(error)))


class RefusalClock:
    """Since when Cassandra has refused writes whatever they hold, across batches: one
    refusal after another (within SLIP_GAP_S of the last) is one slip, waited out once;
    an outage between them starts the wait again after it."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._last = float("-inf")

    def counts(self, error: BaseException, now: float) -> bool:
        """Whether this failed write counts towards dead-lettering its final."""
        if unavailable(error):
            self._since = None
            return False
        if not refusing_all(error):
            return True
        if self._since is None or now - self._last > SLIP_GAP_S:
            self._since = now
        self._last = now
        return now - self._since >= REFUSAL_WAIT_S
