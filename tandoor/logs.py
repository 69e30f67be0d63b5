"""Process-wide logging: one line per event, as text for people or JSON for a log
pipeline (TANDOOR_LOG_FORMAT=json). Every line names its role and, when it concerns a
request, the request id, so one request can be followed from the gateway through the
worker to persistence."""

from __future__ import annotations

import datetime as dt
import logging
import logging.config
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

# Set by whoever handles one request; asyncio tasks started from there inherit it.
current_request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

# httpx: a line per request (a poll a second); the gateway's errors and shedding: a line
# per request refused while a store is down, or shed while a model is busy.
NOISY = ("aiokafka", "cassandra", "httpx", "producers.gateway.errors", "producers.gateway.shedding")
REPEAT_EVERY_S = 5.0
TEXT_FORMAT = "%(asctime)s %(levelname)-5s %(name)s: %(message)s%(request_suffix)s"


def bind_request_id(request_id: str) -> None:
    """Tag this task's log lines (and those of tasks it starts) with `request_id`."""
    current_request_id.set(request_id)


class RequestContext(logging.Filter):
    """Adds `role` and `request_id` to every record; an explicit `extra` wins."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        rid = getattr(record, "request_id", None) or current_request_id.get()
        record.request_id = rid
        record.request_suffix = f" [{rid}]" if rid else ""
        return True


class RepeatLimit(logging.Filter):
    """At most one line per message template and `every_s` from the noisy libraries.
    aiokafka retries a refused connection without backoff (aio-libs/aiokafka#496,
    #1155): while Kafka restarts, a worker logged 15,000 lines a second of "Unable
    connect to node". The next line let through says how many were held back."""

    def __init__(
        self,
        prefixes: tuple[str, ...] = NOISY,
        every_s: float = REPEAT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.every_s = every_s
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (shown at, held)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        key, now = (record.name, str(record.msg)), self._clock()
        shown_at, held = self._seen.get(key, (float("-inf"), 0))
        if now - shown_at < self.every_s:
            self._seen[key] = (shown_at, held + 1)
            return False
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} [{held} more like this held back]"
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "role": getattr(record, "role", None),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            line["request_id"] = rid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def configure_logging(level: str = "INFO", role: str = "tandoor", fmt: LogFormat = "text") -> None:
    global engine_logging
    logging.config.dictConfig(role_logging(level, role, fmt))
    engine_logging = role_logging(level, role, fmt, logger="vllm")
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def role_logging(level: str, role: str, fmt: LogFormat, logger: str = "") -> dict[str, Any]:
    """The role's handler, as `logging.config.dictConfig` takes it, for `logger` (the
    root when empty)."""
    text = {"format": TEXT_FORMAT, "datefmt": "%H:%M:%S"}
    target = {"handlers": ["role"], "level": level}
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "context": {"()": f"{__name__}.RequestContext", "role": role},
            "repeats": {"()": f"{__name__}.RepeatLimit"},
        },
        "formatters": {"role": {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else text},
        "handlers": {
            "role": {
                "class": "logging.StreamHandler",
                "formatter": "role",
                "filters": ["context", "repeats"],
            }
        },
    }
    if logger:
        config["loggers"] = {logger: {**target, "propagate": False}}
    else:
        config["root"] = target
    return config


# The role's handler for vLLM's loggers, for its engine process: Python starts that one
# afresh, and vLLM's own set-up there wrote text lines past a JSON log pipeline.
engine_logging: dict[str, Any] = role_logging("INFO", "tandoor", "text", logger="vllm")
