"""Process-wide logging: one line per event, as text for people or JSON for a log
pipeline (TANDOOR_LOG_FORMAT=json). Every line names its role and, when it concerns a
request, the request id, so one request can be followed from the gateway through the
worker to persistence."""

from __future__ import annotations

import datetime as dt
import logging
from contextvars import ContextVar
from typing import Literal

import orjson

LogFormat = Literal["text", "json"]

# Set by whoever handles one request; asyncio tasks started from there inherit it.
current_request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

NOISY = ("aiokafka", "cassandra")
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
    handler = logging.StreamHandler()
    handler.addFilter(RequestContext(role))
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
