"""The batch band's room, split between admission replicas: each forwarded up to the
whole band's depth, so two replicas (as deployed) filled it twice over."""

from __future__ import annotations

from typing import Any, cast

from producers.admission.band_room import BandRoom
from producers.model_load import ModelLoad
from tandoor.settings import Settings

MODEL = "smollm2"


class Measured:
    def __init__(self, backlog: int) -> None:
        self.measured = ModelLoad({"batch": backlog}, 1, None, 0.0)

    def load(self, model: str) -> ModelLoad:
        return self.measured


def replicas(shares: list[float], backlog: int = 0) -> list[BandRoom]:
    settings = Settings(batch_backlog_per_worker=8)
    load = Measured(backlog)
    rooms = [BandRoom(settings, cast(Any, load)) for _ in shares]
    for room, share in zip(rooms, shares, strict=True):
        room.share = share  # its part of batch.requests' partitions
    return rooms


def test_replicas_together_fill_the_band_once() -> None:
    rooms = replicas([0.5, 0.5])
    assert [room.room(MODEL) for room in rooms] == [4, 4]
    rooms = replicas([0.25, 0.75], backlog=4)  # half of it is held already
    assert [room.room(MODEL) for room in rooms] == [1, 3]


def test_what_a_replica_forwarded_counts_against_its_own_part() -> None:
    one, other = replicas([0.5, 0.5])
    assert one.room(MODEL) == 4  # measured: what is sent from now on counts
    for _ in range(3):
        one.sent(MODEL)
    assert (one.room(MODEL), other.room(MODEL)) == (1, 4)


def test_a_replica_with_a_sliver_of_the_partitions_still_forwards() -> None:
    (sliver,) = replicas([0.05])
    assert sliver.room(MODEL) == 1  # rounded up: never stalled for good
