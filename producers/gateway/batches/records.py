"""What the file and batch store gives back: files, batches, and their lines answered."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class StoredFile:
    file_id: str
    user_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: dt.datetime


@dataclass(frozen=True)
class Answered:
    """A batch's lines answered so far, by outcome, and when the last was answered."""

    succeeded: int = 0  # HTTP 200
    failed: int = 0  # any other answer, `unstatused` included
    unstatused: int = 0  # errors without an HTTP status (the window ended them)
    last_at: dt.datetime | None = None

    @classmethod
    def of(cls, codes: Iterable[int | None], last_at: dt.datetime | None = None) -> Answered:
        counted = Counter("ok" if c == 200 else "none" if c is None else "failed" for c in codes)
        unstatused = counted["none"]
        return cls(counted["ok"], counted["failed"] + unstatused, unstatused, last_at)

    @property
    def count(self) -> int:
        return self.succeeded + self.failed


@dataclass(frozen=True)
class StoredBatch:
    batch_id: str
    user_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    total: int
    metadata: dict[str, str] | None
    created_at: dt.datetime
    cancelled_at: dt.datetime | None
    settled: Answered | None = None  # its final counts, once no answer can change them
    queuing: bool = False  # its lines not yet all in Kafka (a gateway died meanwhile?)


class Held(NamedTuple):
    files: int
    bytes: int
