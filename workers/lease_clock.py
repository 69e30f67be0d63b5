"""When Redis last told this worker that a request's lease is its own. Past the lease's
length since, with Redis out of reach from here alone (this host's network, this
process's breaker), another worker may have taken the request over from a Redis that
answers it: this worker then publishes nothing until Redis says whose the lease is."""

from __future__ import annotations

import time

# Of the lease, what is trusted after Redis last said "yours": Redis counts the lease
# from when it ran the call, this clock from before the call was sent, and the two
# clocks may run at slightly different rates.
TRUSTED_SHARE = 0.8


class LeaseClock:
    def __init__(self, lease_s: float) -> None:
        self._trusted_s = lease_s * TRUSTED_SHARE
        self._until: dict[str, float] = {}  # request id: trusted until (monotonic)

    def confirmed(self, request_id: str, asked_at: float) -> None:
        """Redis, asked at `asked_at` (monotonic), answered that the lease is ours."""
        until = asked_at + self._trusted_s
        self._until[request_id] = max(until, self._until.get(request_id, until))

    def lapsed(self, request_id: str) -> bool:
        """Whether another worker may hold the lease by now."""
        return time.monotonic() > self._until.get(request_id, float("-inf"))

    def forget(self, request_id: str) -> None:
        self._until.pop(request_id, None)
