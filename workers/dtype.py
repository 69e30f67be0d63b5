"""The dtype an engine computes in. `auto` takes bf16 only where the hardware computes it
natively: a GPU of compute capability 8.0 or newer, or a CPU with AVX-512 BF16, AMX or
Arm's BF16. Elsewhere bf16 is emulated and several times slower than float32 (measured on
an AVX2-only AMD EPYC: torch's bf16 matmul 0.9 GFLOP/s against 103 in float32; vLLM 17
chunks/s against 48 at 16 streams), so a CPU without it runs float32, and an older GPU
float16 where the model allows it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandoor.models import Dtype

# /proc/cpuinfo names: x86 "avx512_bf16" and "amx_bf16"; aarch64 "bf16" (FEAT_BF16).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
BF16_GPU_CAPABILITY = (8, 0)  # Ampere and newer


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str


def choose_dtype(
    requested: Dtype,
    gpu_capability: tuple[int, int] | None,
    cpu_flags: frozenset[str],
    quantized: bool = False,
) -> DtypeChoice:
    """`requested` as is, or for `auto` what this hardware computes natively.
    `gpu_capability` is None on a CPU; `quantized`: the model's weights are (vLLM runs
    AWQ, GPTQ, fp8 and the like in float16 or bfloat16 only)."""
    if requested != "auto":
        return DtypeChoice(requested, "configured")
    if gpu_capability is not None:
        major, minor = gpu_capability
        if gpu_capability >= BF16_GPU_CAPABILITY:
            return DtypeChoice("bfloat16", f"GPU compute capability {major}.{minor}")
        # vLLM's own auto there: float16, or float32 for the models float16 breaks
        # (Gemma 3: passed float16 outright, the bundled second model refused to start).
        return DtypeChoice(
            "auto",
            f"GPU compute capability {major}.{minor} lacks bf16: float16 where the "
            "model takes it, else float32 (vLLM's choice)",
        )
    native = sorted(NATIVE_BF16_CPU_FLAGS & cpu_flags)
    if native:
        return DtypeChoice("bfloat16", f"CPU computes bf16 natively ({', '.join(native)})")
    if quantized:  # float32 made vLLM refuse to start ("not supported for quantization")
        return DtypeChoice(
            "bfloat16", "quantized model: 16-bit only, though this CPU emulates bf16 (slow)"
        )
    return DtypeChoice("float32", "CPU without native bf16 (no AVX-512 BF16, AMX or BF16)")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (x86 `flags`, Arm `Features`)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(requested: Dtype, quantized: bool = False) -> DtypeChoice:
    """choose_dtype on the platform vLLM runs on here (imports vLLM: call it where an
    engine starts)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return choose_dtype(requested, None, cpu_flags(), quantized)
    capability = current_platform.get_device_capability()
    if capability is None:  # an accelerator that reports none: vLLM's own rule
        auto = DtypeChoice("auto", f"vLLM's choice on {current_platform.device_name}")
        return auto if requested == "auto" else DtypeChoice(requested, "configured")
    return choose_dtype(requested, (capability.major, capability.minor), frozenset())
