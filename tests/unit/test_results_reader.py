"""ResultsReader's view of a batch's results: one per id, as api.md tells clients to keep."""

from __future__ import annotations

from producers.batch_topic import ResultsReader


async def test_a_result_delivered_twice_is_counted_once() -> None:
    """After a crash a result may come twice: a client waiting for len(of(batch)) to
    reach its line count stopped early, its last lines unanswered."""
    reader = ResultsReader("127.0.0.1:1")  # never started: fed by hand
    first, again = {"id": "batch_req_1", "n": 1}, {"id": "batch_req_1", "n": 2}
    second = {"id": "batch_req_2"}
    reader.results["b"] = [first, again, second]
    assert reader.of("b") == [first, second]
    assert reader.copies("b") == [first, again, second]
    await reader.stop()
