"""Where an engine runs its model: `uni` in the engine-core process itself, `mp` in a
worker process of its own (vLLM's `distributed_executor_backend`).

vLLM on CPU always takes `mp`, for its OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND),
which it can set only in a process that has not imported torch yet. That costs a third
process (one more import of torch and vLLM at every start) and a worker that polls its
message queue, competing with the model for the cores. `auto` takes `uni` on a CPU with
one engine per model (tensor_parallel_size 1): measured on a 2-core Xeon (AVX-512 BF16)
with SmolLM2, the engine started in 36 s instead of 53 s and decoded 209 tokens/s at 16
streams instead of 147 (bench/engine_options.py). Choose `mp` where the binding matters
(large multi-socket CPUs); elsewhere `auto` leaves the choice to vLLM."""

from __future__ import annotations

import os

from tandoor.models import Executor

# vLLM reads this when it checks the configuration: "0" keeps `uni` on a CPU. The engine
# core still runs in a child process of its own (AsyncLLM always starts one).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def choose_executor(requested: Executor, on_cpu: bool, tensor_parallel_size: int) -> str | None:
    """The backend for `requested`; None leaves vLLM's own choice."""
    if requested != "auto":
        return requested
    return "uni" if on_cpu and tensor_parallel_size == 1 else None


def resolve_executor(requested: Executor, tensor_parallel_size: int) -> str | None:
    """choose_executor on the platform vLLM runs on here, with the environment vLLM
    needs to honour it (imports vLLM: call it where an engine starts)."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    backend = choose_executor(requested, on_cpu, tensor_parallel_size)
    if on_cpu:
        os.environ[MULTIPROCESSING_ENV] = "0" if backend == "uni" else "1"
    return backend
