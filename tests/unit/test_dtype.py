"""dtype auto: bf16 only where the hardware computes it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.dtype import choose_dtype, cpu_flags

AVX2_EPYC = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize(
    ("gpu", "flags", "expected"),
    [
        (None, AVX2_EPYC, "float32"),
        (None, AVX2_EPYC | {"avx512f", "avx512bw"}, "float32"),  # AVX-512 without BF16
        (None, AVX2_EPYC | {"avx512_bf16"}, "bfloat16"),
        (None, SAPPHIRE_RAPIDS, "bfloat16"),
        (None, frozenset({"fp", "asimd", "bf16"}), "bfloat16"),  # Arm with FEAT_BF16
        (None, frozenset(), "float32"),  # unknown CPU: the safe choice
        ((9, 0), frozenset(), "bfloat16"),  # H100/H200
        ((8, 0), AVX2_EPYC, "bfloat16"),  # the GPU decides, not the host CPU
        # T4: no bf16; float16 is vLLM's to choose (Gemma 3, the second model, refuses it)
        ((7, 5), SAPPHIRE_RAPIDS, "auto"),
    ],
)
def test_auto_follows_the_hardware(
    gpu: tuple[int, int] | None, flags: frozenset[str], expected: str
) -> None:
    choice = choose_dtype("auto", gpu, flags)
    assert choice.dtype == expected
    assert choice.reason  # the worker logs why


def test_a_quantized_model_on_a_cpu_without_bf16_gets_16_bits() -> None:
    """float32 there: vLLM refused to start an AWQ, GPTQ or fp8 model (16 bits only),
    with a traceback."""
    assert choose_dtype("auto", None, AVX2_EPYC, quantized=True).dtype == "bfloat16"
    assert choose_dtype("auto", None, SAPPHIRE_RAPIDS, quantized=True).dtype == "bfloat16"
    assert choose_dtype("auto", None, AVX2_EPYC, quantized=False).dtype == "float32"


def test_a_configured_dtype_is_kept() -> None:
    assert choose_dtype("bfloat16", None, AVX2_EPYC).dtype == "bfloat16"
    assert choose_dtype("float32", (9, 0), frozenset()).dtype == "float32"


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "fma"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
