"""The count of waiting lines per partition that admission's buffer shares are read
from: kept as lines come and go, never drifting from the lines themselves."""

from __future__ import annotations

from producers.admission.waiting import WaitingLines


def test_counts_follow_lines_added_repeated_forwarded_and_revoked() -> None:
    lines = WaitingLines()
    lines.add("r-a", "0:10")
    lines.add("r-b", "0:11")
    lines.add("r-c", "3:7")
    lines.add("r-a", "0:10")  # read again (a replay): one line, not two
    assert (lines.per_partition[0], lines.per_partition[3], len(lines)) == (2, 1, 3)
    lines.discard("r-b")  # forwarded
    lines.discard("r-b")  # and again: no effect
    assert lines.per_partition[0] == 1 and lines.where("r-b") is None
    lines.drop_partitions({0})  # revoked: the new owner reads it again
    assert lines.per_partition[0] == 0 and lines.where("r-a") is None
    assert lines.where("r-c") == "3:7" and len(lines) == 1
