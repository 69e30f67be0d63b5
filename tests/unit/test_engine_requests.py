"""The engine wrapper turns whatever vLLM refuses about one request into RequestFailed,
which the worker answers with an error final; anything else stops the worker. Sampling
settings vLLM refuses were built before the guard: the worker stopped on them (pure
logic: vLLM's own SamplingParams, a stand-in for the engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas.events import Sampling
from workers.engine import Engine, RequestFailed


class StandInLLM:
    def generate(self, *_: Any) -> AsyncIterator[Any]:
        raise AssertionError("nothing reaches the engine")


async def test_sampling_settings_vllm_refuses_fail_the_request_not_the_worker() -> None:
    engine = Engine(StandInLLM(), tokenizer=None, max_model_len=2048)
    unchecked = Sampling.model_construct(**(Sampling().model_dump() | {"stop": [""]}))
    with pytest.raises(RequestFailed, match="empty string"):
        async for _ in engine.generate("r", [1, 2, 3], unchecked):
            pass
