"""What machine a benchmark ran on, printed before its figures: engine speed differs
several-fold between CPUs (AVX-512 or AMX against AVX2 only) and on a GPU."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tandoor.settings import Settings
from workers.dtype import NATIVE_BF16_CPU_FLAGS, cpu_flags

SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe_machine(settings: Settings | None = None) -> str:
    """One line: CPU model, cores, speed-relevant flags, and the engine dtype (imports
    vLLM to tell a GPU from a CPU)."""
    from workers.dtype import resolve_dtype

    flags = cpu_flags()
    present = [f for f in SPEED_FLAGS if f in flags] or ["none of " + ", ".join(SPEED_FLAGS)]
    native = "native bf16" if NATIVE_BF16_CPU_FLAGS & flags else "no native bf16"
    dtype = resolve_dtype(next(iter((settings or Settings()).models.values())).dtype)
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} cores, flags {' '.join(present)} "
        f"({native}); engine dtype {dtype.dtype} ({dtype.reason})"
    )
