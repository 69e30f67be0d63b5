"""Log lines: the repeat limit on the noisy libraries, with a hand-driven clock."""

from __future__ import annotations

import json
import logging
import logging.config
from collections.abc import Iterator

import orjson
import pytest

from tandoor.logs import RepeatLimit, role_logging


def record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_one_template_becomes_a_line_per_period_with_a_count() -> None:
    clock = Clock()
    limit = RepeatLimit(("aiokafka",), every_s=5.0, clock=clock)
    template = "Unable connect to node with id %s: %s"
    first = record("aiokafka", template, 1, "refused")
    assert limit.filter(first) and first.getMessage() == "Unable connect to node with id 1: refused"
    held = [limit.filter(record("aiokafka", template, n, "refused")) for n in range(1000)]
    assert not any(held)
    clock.now += 5.0
    after = record("aiokafka", template, 2, "refused")
    assert limit.filter(after)
    assert (
        after.getMessage()
        == "Unable connect to node with id 2: refused [1000 more like this held back]"
    )
    clock.now += 5.0
    quiet = record("aiokafka", template, 3, "refused")
    assert limit.filter(quiet) and "held back" not in quiet.getMessage()


def test_other_templates_and_other_loggers_are_never_held() -> None:
    limit = RepeatLimit(("aiokafka",), every_s=5.0, clock=Clock())
    assert limit.filter(record("aiokafka", "Unable to update metadata from %s", [1]))
    assert limit.filter(
        record("aiokafka.consumer.fetcher", "Unable to update metadata from %s", [1])
    )
    assert limit.filter(record("aiokafka", "Failed fetch messages from %s", 1))
    ours = [limit.filter(record("workers.request", "stored %s", n)) for n in range(50)]
    assert all(ours)


@pytest.fixture
def vllm_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("vllm")
    yield logger
    logger.handlers.clear()
    logger.propagate = True


def test_vllms_lines_are_the_roles_json_lines(
    vllm_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's own set-up, in the worker and in its engine process, wrote text lines to
    stdout: a JSON log pipeline got lines it could not parse, with no role. Its engine
    process reads this configuration from a file, so it goes through JSON too."""
    written = orjson.dumps(role_logging("INFO", "worker", "json", logger="vllm"))
    logging.config.dictConfig(json.loads(written))
    logging.getLogger("vllm.v1.engine.core").info("engine ready")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (line["role"], line["logger"], line["msg"]) == (
        "worker",
        "vllm.v1.engine.core",
        "engine ready",
    )
