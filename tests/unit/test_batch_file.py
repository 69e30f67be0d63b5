"""Reading batch files: every line checked before anything is sent; stable ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.batch import BatchError, batch_id_for, read_batch
from schemas.batch import line_of, line_request_id


def test_lines_take_a_prompt_or_messages(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"prompt": "Hi"}\n\n{"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 9}\n'
    )
    _, lines = read_batch(path)
    assert [line.chat()[0].content for line in lines] == ["Hi", "Yo"]
    assert lines[1].max_tokens == 9


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"prompt": "a"}\nnot json\n', "in.jsonl:2: not JSON"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one"),
        ('{"prompt": "a", "max_tokens": 0}', "in.jsonl:1: max_tokens"),
        ('{"prompt": "a", "colour": "red"}', "colour"),
        ("\n\n", "no prompts"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(BatchError, match=problem):
        read_batch(path)


def test_the_same_file_is_the_same_batch_for_the_same_owner_and_model() -> None:
    same = batch_id_for("ada", "m", b"x")
    assert same == batch_id_for("ada", "m", b"x")
    assert len({same, batch_id_for("bob", "m", b"x"), batch_id_for("ada", "n", b"x")}) == 3


def test_request_ids_name_their_line() -> None:
    assert line_of(line_request_id("b_1f", 42)) == 42
    assert line_of("r_abc") is None
