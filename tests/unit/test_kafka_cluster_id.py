"""The KRaft cluster id handed to `kafka-storage format -t`."""

from __future__ import annotations

import base64
import uuid

import pytest

from infra import kafka_server


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """One random id in 64 starts with "-", and StorageTool then reads it as an option
    (CI failed so once): those are drawn again."""
    dash_first = uuid.UUID(bytes=b"\xf8" + bytes(15))  # base64 "-A..."
    plain = uuid.UUID(bytes=b"\x00" * 16)
    draws = iter([dash_first, plain])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(draws))
    assert base64.urlsafe_b64encode(dash_first.bytes).decode().startswith("-")
    assert kafka_server.new_cluster_id() == "AAAAAAAAAAAAAAAAAAAAAA"


def test_cluster_ids_are_22_url_safe_characters() -> None:
    ids = {kafka_server.new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
