"""Every Redis key Tandoor uses, named in one place: what it holds, who writes it, and how
long it lives. Roles build keys only through these functions."""

from __future__ import annotations

PREFIX = "tandoor"

ATTEMPT_TTL_S = 24 * 3600
CANCEL_TTL_S = 3600
# A reply's published text and a final not yet known delivered: needed only while some
# worker may still take the request over.
REPLY_TTL_S = 3600
# A final not yet delivered lives as long as the request's done mark: a prompt redelivered
# later finds the request done and must find the final too, or its reply never ends.
FINAL_TTL_S = ATTEMPT_TTL_S
TITLED_TTL_S = 30 * 24 * 3600


# Requests (gateway and workers).


def attempt_key(request_id: str) -> str:
    """A request's current attempt: a worker that takes it again runs the next one."""
    return f"{PREFIX}:attempt:{request_id}"


def done_key(request_id: str) -> str:
    """Set once a request is finished or withdrawn: workers drop it on arrival."""
    return f"{PREFIX}:done:{request_id}"


def arrival_key(request_id: str) -> str:
    """The call that took the lease last: the same call sent again (its answer lost to a
    dropped connection) is answered as it was, not refused as busy."""
    return f"{PREFIX}:arrival:{request_id}"


def lease_key(request_id: str) -> str:
    """The worker generating the request now, for as long as it renews the lease: no
    other worker starts it meanwhile (workers/ledger.py)."""
    return f"{PREFIX}:lease:{request_id}"


def reply_key(request_id: str) -> str:
    """The token events a worker published for the request, in order (a list): the next
    attempt continues the reply from them instead of starting over."""
    return f"{PREFIX}:reply:{request_id}"


def final_key(request_id: str) -> str:
    """The final event, kept from just before it is published until it is delivered: a
    worker that takes the request over meanwhile publishes the same final."""
    return f"{PREFIX}:final:{request_id}"


def cancel_key(request_id: str) -> str:
    """A cancel that may come before any worker has taken the prompt."""
    return f"{PREFIX}:cancel:{request_id}"


def inflight_key(conversation_id: str) -> str:
    """The reply a conversation is generating now (stop, resume, regenerate)."""
    return f"{PREFIX}:inflight:{conversation_id}"


def newest_reply_key(conversation_id: str) -> str:
    """The conversation's newest queued reply (request id, prompt time), set by the
    gateway: the next turn waits for it to be stored (producers/gateway/chat/newest.py)."""
    return f"{PREFIX}:newest:{conversation_id}"


def titled_key(conversation_id: str) -> str:
    """Set once a conversation's title job was asked for: it is asked once."""
    return f"{PREFIX}:titled:{conversation_id}"


# Quotas (tandoor/policies/quota.py).


def quota_account(user_id: str, tier: str) -> str:
    """Whose counters a request is charged to: a user's, in the tier of the key it came
    with (each tier's limits count its own requests: one counter per user, a batch key's
    6,000 lines a minute refused the same user's chat key at its limit of 60)."""
    return f"{user_id}:{tier}"


def requests_log_key(account: str) -> str:
    """The account's requests of the last minute (a sorted set: requests per minute)."""
    return f"{PREFIX}:quota:rpm:{account}"


def tokens_window_key(account: str, window_start_ms: int) -> str:
    """Tokens charged in one fixed minute window (tokens per minute)."""
    return f"{PREFIX}:quota:tpm:{account}:{window_start_ms}"


def streams_key(account: str) -> str:
    """The account's open streams, each with its lease's end (concurrent streams)."""
    return f"{PREFIX}:quota:streams:{account}"


def settled_key(request_id: str) -> str:
    """Set once a request's estimate was replaced with its real usage."""
    return f"{PREFIX}:quota:settled:{request_id}"


# API keys (tandoor/policies/api_keys.py).


def api_key_cache_key(digest: str) -> str:
    """Who a key (by its SHA-256 digest) acts for, cached from Cassandra."""
    return f"{PREFIX}:apikey:{digest}"


# Batch admission (producers/admission/).

BATCH_LINE_TTL_S = 7 * 24 * 3600  # as long as `batch.requests` keeps a line


def batch_line_key(request_id: str) -> str:
    """Where on `batch.requests` a batch line was read ("partition:offset") once it was
    forwarded or answered: the same record read again after a crash is skipped, and
    another record with the same custom_id is a duplicate."""
    return f"{PREFIX}:batchline:{request_id}"


def batch_cancel_key(user_id: str, batch_id: str) -> str:
    """Set when a batch is cancelled: admission answers its lines not yet forwarded as
    cancelled instead of running them."""
    return f"{PREFIX}:batchcancel:{user_id}:{batch_id}"
