"""executor auto: the model runs in the engine-core process on a CPU, one process fewer."""

from __future__ import annotations

import pytest

from workers.executor import choose_executor


@pytest.mark.parametrize(
    ("on_cpu", "tensor_parallel_size", "expected"),
    [
        (True, 1, "uni"),  # vLLM would start a worker process of its own
        (False, 1, None),  # a GPU: vLLM's choice (uni for one GPU already)
        (False, 2, None),  # vLLM's choice: a process per GPU
    ],
)
def test_auto(on_cpu: bool, tensor_parallel_size: int, expected: str | None) -> None:
    assert choose_executor("auto", on_cpu, tensor_parallel_size) == expected


def test_a_configured_executor_is_kept() -> None:
    assert choose_executor("mp", True, 1) == "mp"  # the OpenMP binding wanted
    assert choose_executor("uni", False, 1) == "uni"
