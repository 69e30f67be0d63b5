"""Topic names and the priority-band layout of prompt topics."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

TOKENS = "tokens"
CONTROL = "control"
USAGE = "usage"
USAGE_ROLLUPS = "usage.rollups"  # the streams app's output, keyed by rollup
# Batch lines in OpenAI's batch input form, keyed by batch id, from any Kafka client;
# the admission role answers refused lines, the persistence consumer the rest.
BATCH_REQUESTS = "batch.requests"
BATCH_RESULTS = "batch.results"
BATCH_PARTITIONS = 8
DEAD_LETTER = "dead-letter"  # not under prompts.: no model can shadow it
PROMPTS_PREFIX = "prompts."
# `usage` and `usage.rollups`: the streams app's tables are co-partitioned with `usage`
# (faust checks it and crashes otherwise), so bootstrap and the app share this number.
USAGE_PARTITIONS = 4


MAX_MODEL_NAME = 200  # Kafka's topic names end at 249 characters


def prompts_topic(model: str) -> str:
    if not (0 < len(model) <= MAX_MODEL_NAME) or not all(
        c.isascii() and (c.isalnum() or c in "-_.") for c in model
    ):
        raise ValueError(
            f"model name {model!r} is not a valid topic suffix: 1 to {MAX_MODEL_NAME} of "
            "A-Z a-z 0-9 . _ - (serve 'org/model' as 'org-model' or similar)"
        )
    return PROMPTS_PREFIX + model


def worker_group(model: str) -> str:
    """The consumer group of a model's workers: its commits mark finished prompts."""
    return f"workers.{model}"


@dataclass(frozen=True)
class BandRange:
    name: str
    first: int  # first partition of the band
    count: int

    @property
    def partitions(self) -> range:
        return range(self.first, self.first + self.count)


class BandLayout:
    """Maps priority bands to partition ranges, highest priority first."""

    def __init__(self, bands: Sequence[tuple[str, int]]) -> None:
        ranges: list[BandRange] = []
        first = 0
        for name, count in bands:
            ranges.append(BandRange(name, first, count))
            first += count
        self.ranges = ranges
        self.total_partitions = first
        self._by_name = {band.name: band for band in ranges}

    def band(self, name: str) -> BandRange:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(
                f"unknown priority band {name!r}; known: {list(self._by_name)}"
            ) from None

    def partition_for(self, band: str, conversation_id: str) -> int:
        """Same conversation, same partition: follow-up turns meet their cached prefix."""
        rng = self.band(band)
        return rng.first + zlib.crc32(conversation_id.encode()) % rng.count

    def band_of(self, partition: int) -> BandRange:
        for rng in self.ranges:
            if partition in rng.partitions:
                return rng
        raise ValueError(f"partition {partition} is outside every band")


def dead_letter_headers(
    topic: str, partition: int, offset: int, reason: str
) -> list[tuple[str, bytes]]:
    """What every record on DEAD_LETTER carries: why it is there, and where it was read."""
    return [("error", reason.encode()[:1000]), ("source", f"{topic}/{partition}/{offset}".encode())]
