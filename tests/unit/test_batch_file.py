"""Reading batch files: every line checked before anything is sent, then OpenAI batch input."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from producers.batch import BatchError, read_batch

ASKED = {"role": "user", "content": "a"}


def jsonl(**line: object) -> str:
    return json.dumps(line)


def test_lines_take_a_prompt_or_messages(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"prompt": "Hi"}\n\n{"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 9}\n'
    )
    lines = read_batch(path)
    assert [(n, line.chat()[0].content) for n, line in lines] == [(1, "Hi"), (3, "Yo")]
    assert lines[1][1].max_tokens == 9


def test_a_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Notepad's UTF-8 starts with one: the gateway's upload takes such a file, and the
    command refused it ("line 1: not JSON")."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + b'{"prompt": "Hi"}\n{"prompt": "Yo"}\n')
    lines = read_batch(path)
    assert [(n, line.chat()[0].content) for n, line in lines] == [(1, "Hi"), (2, "Yo")]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"prompt": "a"}\nnot json\n', "in.jsonl:2: not JSON"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one"),
        ('{"prompt": "a", "max_tokens": 0}', "in.jsonl:1: max_tokens"),
        ('{"prompt": "a", "colour": "red"}', "colour"),
        ("\n\n", "no prompts"),
        # What the gateway refuses is refused before the upload, not answered line by
        # line after the batch was made and charged.
        (jsonl(prompt="x" * 32_001), "in.jsonl:1: prompt: String should have at most"),
        (jsonl(messages=[ASKED, {"role": "assistant", "content": "b"}]), "from the user"),
        (jsonl(messages=[{**ASKED, "tool_calls": [{}]}]), "tool_calls"),
        (jsonl(messages=[ASKED] * 501), "at most 500"),
        (jsonl(prompt="a", max_tokens=True), "max_tokens: Input should be a valid integer"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(BatchError, match=problem):
        read_batch(path)


def test_a_line_the_api_takes_is_taken(tmp_path: Path) -> None:
    """A `developer` message and content as text parts were refused here, not there."""
    path = tmp_path / "in.jsonl"
    parts = '[{"type": "text", "text": "Hi"}]'
    path.write_text(
        '{"messages": [{"role": "developer", "content": "Be brief."}, '
        f'{{"role": "user", "content": {parts}}}]}}\n'
    )
    ((_, line),) = read_batch(path)
    assert line.request(1, "m")["body"]["messages"] == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_lines_become_openai_batch_input_named_by_their_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "Hi", "temperature": 0.5}\n')
    ((_, line),) = read_batch(path)
    request = line.request(7, "smollm2")
    assert request["custom_id"] == "line-7" and request["url"] == "/v1/chat/completions"
    assert request["body"] == {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 256,
        "temperature": 0.5,
    }
