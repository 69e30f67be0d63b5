"""The Virtual Token Counter of producers/admission/fairness.py: a flood gets an equal
share, never more, and idling earns no credit."""

from __future__ import annotations

from producers.admission.fairness import FairQueue

COST = 100


def serve(queue: FairQueue[str], count: int, now: float = 0.0) -> list[str]:
    served = []
    for _ in range(count):
        picked = queue.pop(now)
        if picked is None:
            break
        tenant, item = picked
        queue.charge(tenant, COST)
        served.append(item)
    return served


def test_a_small_batch_behind_a_flood_is_interleaved_one_for_one() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(1000):
        queue.push("flood", f"f{i}")
    assert serve(queue, 50) == [f"f{i}" for i in range(50)]
    for i in range(5):
        queue.push("small", f"s{i}")
    served = serve(queue, 10)
    assert sorted(served) == sorted([f"f{i}" for i in range(50, 55)] + [f"s{i}" for i in range(5)])
    assert [s for s in served if s.startswith("s")] == [f"s{i}" for i in range(5)]  # in order


def test_an_idle_tenant_is_lifted_and_cannot_burst() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push("busy", f"b{i}")
    serve(queue, 60)  # "quiet" had nothing queued: its counter stayed at 0
    for i in range(20):
        queue.push("quiet", f"q{i}")
    served = serve(queue, 20)
    assert sum(s.startswith("q") for s in served) == 10, served


def test_heavier_lines_count_as_more_tokens() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(10):
        queue.push("long", f"l{i}")
        queue.push("short", f"s{i}")
    served = []
    for _ in range(10):
        picked = queue.pop(0)
        assert picked is not None
        tenant, item = picked
        queue.charge(tenant, 400 if tenant == "long" else 100)
        served.append(item)
    assert sum(s.startswith("s") for s in served) == 8, served  # 4:1 tokens, so 8 to 2


def test_a_held_tenant_waits_and_the_others_go_on() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("over", "o0")
    queue.push("fine", "f0")
    tenant, item = queue.pop(0) or ("", "")
    assert (tenant, item) == ("fine", "f0")  # ties go by name: deterministic
    picked = queue.pop(0)
    assert picked == ("over", "o0")
    queue.put_back("over", "o0", held_until=10.0)  # over its quota for 10 s
    queue.push("fine", "f1")
    assert queue.pop(5.0) == ("fine", "f1")
    assert queue.pop(5.0) is None
    assert queue.pop(10.0) == ("over", "o0")
    assert queue.size == 0


def test_removed_lines_leave_the_rest_in_order() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(10):
        queue.push("a", i)
    assert queue.remove(lambda i: i % 2 == 0) == [0, 2, 4, 6, 8]
    assert queue.size == 5
    assert [queue.pop(0) for _ in range(6)] == [("a", i) for i in (1, 3, 5, 7, 9)] + [None]
