from __future__ import annotations

import pytest

from schemas.topics import BandLayout, prompts_topic

LAYOUT = BandLayout([("interactive-paid", 4), ("interactive-free", 4), ("batch", 2)])


def test_bands_take_consecutive_partition_ranges_highest_first() -> None:
    assert [list(b.partitions) for b in LAYOUT.ranges] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert LAYOUT.total_partitions == 10


def test_a_conversation_always_lands_on_the_same_partition_of_its_band() -> None:
    first = LAYOUT.partition_for("interactive-free", "conv-42")
    assert first in LAYOUT.band("interactive-free").partitions
    assert all(LAYOUT.partition_for("interactive-free", "conv-42") == first for _ in range(5))


def test_conversations_spread_over_every_partition_of_a_band() -> None:
    used = {LAYOUT.partition_for("batch", f"conv-{i}") for i in range(200)}
    assert used == set(LAYOUT.band("batch").partitions)


def test_band_of_partition() -> None:
    assert LAYOUT.band_of(5).name == "interactive-free"
    with pytest.raises(ValueError, match="outside every band"):
        LAYOUT.band_of(10)


def test_unknown_band_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="interactive-paid"):
        LAYOUT.partition_for("gold", "c")


@pytest.mark.parametrize("bad", ["", "a b", "x/y", "é"])
def test_prompt_topic_refuses_bad_model_names(bad: str) -> None:
    with pytest.raises(ValueError):
        prompts_topic(bad)


def test_prompt_topic_name() -> None:
    assert prompts_topic("smollm2") == "prompts.smollm2"
