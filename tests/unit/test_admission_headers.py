"""Headers and keys any Kafka client may write on `batch.requests`: what admission makes
of bytes that are not UTF-8, too long, or garbled."""

from __future__ import annotations

import pytest

from producers.admission.headers import (
    MAX_BATCH_ID_CHARS,
    batch_deadline_ms,
    bearer_token,
    check_batch_id,
    text_of,
)
from producers.admission.lines import Refused
from schemas.batch import custom_line_request_id


def test_text_that_is_not_utf8_or_empty_is_absent() -> None:
    assert text_of(b"\xff\xfe") is None and text_of(b"") is None and text_of(None) is None


@pytest.mark.parametrize("batch_id", [None, "", "b" * (MAX_BATCH_ID_CHARS + 1), "é" * 100_000])
def test_a_missing_or_over_long_batch_id_is_the_line_s_400(batch_id: str | None) -> None:
    """Over 256 characters it was cut: the results went under an id its client never
    reads, and two long ids with the same start were one batch."""
    with pytest.raises(Refused) as refused:
        check_batch_id(batch_id)
    assert refused.value.status == 400 and "batch id" in refused.value.message
    assert check_batch_id("b" * MAX_BATCH_ID_CHARS) == "b" * MAX_BATCH_ID_CHARS


def test_a_batch_id_with_a_nul_is_refused_so_no_two_lines_share_a_request_id() -> None:
    """A line's request id hashes owner, batch id and custom_id joined by NUL: a NUL in
    the batch id made ("a\\0b", "c") and ("a", "b\\0c") one id, and the second line
    was taken for a replay of the first and never ran."""
    assert custom_line_request_id("u", "a\0b", "c") == custom_line_request_id("u", "a", "b\0c")
    with pytest.raises(Refused) as refused:
        check_batch_id("a\0b")
    assert refused.value.status == 400 and "NUL" in refused.value.message
    assert check_batch_id("a") == "a"


def test_only_a_bearer_key_is_a_key() -> None:
    assert bearer_token(b"Bearer " + b"k" * 1_000_000) is None  # cached, it would hold 1 MB
    assert bearer_token(b"Bearer  tdr_abc ") == "tdr_abc"
    assert bearer_token(b"bearer tdr_abc") == "tdr_abc"
    assert bearer_token(b"Basic dXNlcg==") is None and bearer_token(b"Bearer ") is None


@pytest.mark.parametrize("garbled", [b"tomorrow", b"-5", b"1e12", b"\xd9\xa1\xd9\xa2", b"9" * 16])
def test_a_garbled_deadline_is_a_400_naming_the_header(garbled: bytes) -> None:
    with pytest.raises(Refused) as refused:
        batch_deadline_ms(garbled)
    assert refused.value.status == 400 and "batch-deadline-ms" in str(refused.value.message)


def test_a_deadline_in_ms_is_read_and_none_is_no_deadline() -> None:
    assert batch_deadline_ms(b"1764633600000") == 1_764_633_600_000
    assert batch_deadline_ms(None) is None
