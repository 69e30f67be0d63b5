"""The side-by-side benchmarks' rounds (bench/loadgen.py): each round's targets run in
turn, and the summary is each load level's median over the rounds, not a mix of levels
or of rounds."""

from __future__ import annotations

import asyncio

import pytest

from bench.loadgen import RunStats, alternate, compare, median_ratios
from bench.vllm_server import refuse_taken


def level(concurrency: int, tokens: int, ttft_s: float) -> RunStats:
    return RunStats(concurrency, ttft_s=[ttft_s], output_tokens=tokens, wall_s=1.0)


def test_each_levels_median_is_taken_over_the_rounds() -> None:
    direct = [("direct", level(1, 100, 0.100)), ("direct", level(32, 1000, 2.0))]
    rounds = [
        (direct, [("path", level(1, 90, 0.150)), ("path", level(32, 800, 2.5))]),
        (direct, [("path", level(1, 50, 0.110)), ("path", level(32, 950, 2.1))]),
        (direct, [("path", level(1, 95, 0.400)), ("path", level(32, 900, 2.2))]),
    ]
    one, thirty_two = median_ratios(rounds, "path").splitlines()
    assert one.startswith(
        "concurrency 1, 3 of 3 rounds valid: path/direct throughput median 90.0% "
    )
    assert "TTFT p50 delta median +50.0 ms" in one
    assert thirty_two.startswith(
        "concurrency 32, 3 of 3 rounds valid: path/direct throughput median 90.0%"
    )
    assert "(80.0%, 95.0%, 90.0%)" in thirty_two
    assert "TTFT p50 delta median +200.0 ms" in thirty_two


def test_the_targets_alternate_round_by_round_and_which_goes_first_too() -> None:
    """The direct server always went first: a machine that drifts over a run (18.7 to
    33.9 tokens/s in one recorded run) favoured one side in every round."""
    order: list[str] = []

    def target(name: str) -> list[tuple[str, RunStats]]:
        order.append(name)
        return [(name, level(1, 10, 0.1))]

    pairs = alternate(3, lambda: target("direct"), lambda: target("path"), "path")
    assert order == ["direct", "path", "path", "direct", "direct", "path"]
    assert [(d[0][0], o[0][0]) for d, o in pairs] == [("direct", "path")] * 3


def test_a_level_with_errors_says_its_ratio_is_invalid() -> None:
    """A refused request frees its stream for the next: the engine stays as busy, and a
    gateway that shed half its load showed the same tokens/s."""
    shed = level(32, 1000, 2.0)
    shed.errors = 4
    clean = compare([("direct", level(32, 1000, 2.0))], [("path", level(32, 1000, 2.0))], "path")
    assert "INVALID" not in clean
    flagged = compare([("direct", level(32, 1000, 2.0))], [("path", shed)], "path")
    assert flagged.splitlines()[-1].endswith("errors 4 vs 0 (INVALID: errors)")


def test_rounds_with_errors_are_left_out_of_the_medians() -> None:
    """A round whose refused requests freed their streams stood in the headline median
    as if it were clean; a level where every direct request failed ended the whole run
    with a ZeroDivisionError after both halves had run."""
    broken = level(32, 950, 2.0)
    broken.errors = 6
    direct = [("direct", level(32, 1000, 2.0))]
    rounds = [
        (direct, [("path", broken)]),
        (direct, [("path", level(32, 800, 2.0))]),
        (direct, [("path", level(32, 900, 2.0))]),
    ]
    summary = median_ratios(rounds, "path")
    assert summary.startswith("concurrency 32, 2 of 3 rounds valid: path/direct throughput")
    assert "median 85.0% (80.0%, 90.0%)" in summary
    failed = level(32, 0, 2.0)
    failed.errors = 32
    assert "nan%" in compare([("direct", failed)], [("path", level(32, 900, 2.0))], "path")
    assert "no median" in median_ratios([([("direct", failed)], [("path", broken)])], "path")


async def test_the_direct_server_is_not_started_on_a_port_something_answers() -> None:
    """A server left from a killed run answered the health check in place of the one
    starting: its figures stood for the direct server's."""
    left = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = left.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=f"port {port} is taken"):
            await refuse_taken(port)
    finally:
        left.close()
        await left.wait_closed()
    await refuse_taken(port)  # free again
