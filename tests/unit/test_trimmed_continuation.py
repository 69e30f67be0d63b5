"""A reply continued after a worker's crash, with a chat template that trims messages
(Llama 3's `| trim`): the prompt ended "Hello," for the published "Hello, ", the engine
wrote " world" again, and the reply read "Hello,  world"."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.unit.test_transcript_records import attempt, streaming_runner
from workers.engine import EngineOutput
from workers.ledger import Recorded
from workers.trimmed import LeadingWhitespace, trimmed_tail


def test_what_the_template_trimmed_off_the_end_is_found() -> None:
    assert trimmed_tail("<turn>assistant\nHello,", "Hello, ") == " "
    assert trimmed_tail("<turn>assistant\nSteps:", "Steps:\n\n") == "\n\n"
    assert trimmed_tail("<turn>assistant\nHello, ", "Hello, ") == ""  # kept: nothing to take
    assert trimmed_tail("<turn>assistant\nHello", "Hello") == ""


@pytest.mark.parametrize(
    ("trimmed", "deltas", "shown"),
    [
        (" ", [" world", " again"], "world again"),
        ("\n\n", ["\n", "\n1.", " Mix"], "1. Mix"),
        ("\n\n", ["\n\n\n", "1."], "\n1."),  # past what was trimmed: the model's own
        (" ", ["world"], "world"),  # the model did not write it again: nothing taken
        ("", [" world"], " world"),  # a template that keeps it: untouched
        (" ", ["", " world"], "world"),  # an empty delta first (a token of no text)
        (" ", ["\n\nWorld"], "\n\nWorld"),  # other whitespace: the model's own paragraph
        ("\n\n", [" 1."], " 1."),
    ],
)
def test_what_was_trimmed_is_taken_off_the_continuation_where_repeated(
    trimmed: str, deltas: list[str], shown: str
) -> None:
    untrimmed = LeadingWhitespace(trimmed)
    assert "".join(untrimmed(delta) for delta in deltas) == shown


class WritesTheSpaceAgain:
    async def generate(
        self, request_id: str, token_ids: object, sampling: object
    ) -> AsyncIterator[EngineOutput]:
        yield EngineOutput(" world", 1, False, None, 3, 0)
        yield EngineOutput("!", 1, True, "stop", 3, 0)


async def test_a_continued_reply_reads_as_one_after_a_trimming_template() -> None:
    runner = streaming_runner(WritesTheSpaceAgain(), 0.0)
    continuing = attempt()
    continuing.carried = (Recorded(1, 0, "Hello, ", 2),)
    continuing.text, continuing.seq, continuing.trimmed = ["Hello, "], 1, " "
    assert await runner._stream(continuing, [1, 2, 3], 16) == "stop"
    assert "".join(continuing.text) == "Hello, world!"
