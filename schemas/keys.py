"""Redis keys shared between roles, named in one place."""

ATTEMPT_TTL_S = 24 * 3600
CANCEL_TTL_S = 3600


def attempt_key(request_id: str) -> str:
    return f"tandoor:attempt:{request_id}"


def done_key(request_id: str) -> str:
    return f"tandoor:done:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"tandoor:cancel:{request_id}"
