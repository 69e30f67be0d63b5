"""The side-by-side benchmarks' rounds (bench/loadgen.py): each round's targets run in
turn, and the summary is each load level's median over the rounds, not a mix of levels
or of rounds."""

from __future__ import annotations

from bench.loadgen import RunStats, alternate, median_ratios


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
    assert one.startswith("concurrency 1, 3 rounds: path/direct throughput median 90.0% ")
    assert "TTFT p50 delta median +50.0 ms" in one
    assert thirty_two.startswith("concurrency 32, 3 rounds: path/direct throughput median 90.0%")
    assert "(80.0%, 95.0%, 90.0%)" in thirty_two
    assert "TTFT p50 delta median +200.0 ms" in thirty_two


def test_the_targets_alternate_round_by_round() -> None:
    order: list[str] = []

    def target(name: str) -> list[tuple[str, RunStats]]:
        order.append(name)
        return [(name, level(1, 10, 0.1))]

    pairs = alternate(3, lambda: target("direct"), lambda: target("path"), "path")
    assert order == ["direct", "path"] * 3
    assert len(pairs) == 3
