"""The engine numerics the tests' content checks are written for.

Greedy replies of a 135M model flip with the dtype: asked "What is the capital of
France?", SmolLM2's first token in float32 is "The" (log-prob -1.864) ahead of "L"
(-1.963); bfloat16 on a Xeon with AMX swaps them and the reply is a French poem. The
tests pin float32, the same on every CPU; `dtype: auto` (bf16 where the CPU computes it
natively) is tested on its own (tests/unit/test_dtype.py) and measured by the benchmarks.
"""

from __future__ import annotations

REFERENCE_DTYPE = "float32"
