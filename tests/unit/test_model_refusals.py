"""A model configuration vLLM would refuse is refused before the engine starts, in one
line that says what to change, and whatever vLLM still refuses is one line too
(workers/model_check.py, workers/engine.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tandoor.models import ModelConfig, Speculative
from workers.engine import Engine, _engine_args
from workers.model_check import ModelError, engine_options


def model_folder(tmp_path: Path, config: dict[str, Any], tokenizer: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "tokenizer", "longest"),
    [
        ({"max_seq_len": 2048}, {}, 2048),  # MPT
        ({"max_position_embeddings": 4096, "max_seq_length": 2048}, {}, 2048),
        ({"max_target_positions": 448}, {}, 448),  # Whisper
        # Command-R: model_max_length overrides the positions, even when longer.
        ({"max_position_embeddings": 8192, "model_max_length": 131072}, {}, 131072),
        # The tokenizer's own limit caps it; its "no limit" sentinel does not.
        ({"max_position_embeddings": 4096}, {"model_max_length": 1024}, 1024),
        ({"max_position_embeddings": 4096}, {"model_max_length": 10**30}, 4096),
    ],
)
def test_the_window_is_read_from_the_keys_vllm_reads(
    tmp_path: Path, config: dict[str, Any], tokenizer: dict[str, Any], longest: int
) -> None:
    """Four keys of vLLM's nine were read: an MPT window too long passed the check and
    failed in vLLM with a traceback; a Command-R window vLLM allows was refused."""
    folder = model_folder(tmp_path, config, tokenizer)
    engine_options("m", ModelConfig(source=str(folder), max_model_len=longest), folder)
    with pytest.raises(ModelError, match=f"longer than the model's {longest} positions"):
        engine_options("m", ModelConfig(source=str(folder), max_model_len=longest + 1), folder)


def quantized_folder(tmp_path: Path, method: str) -> Path:
    config = {"max_position_embeddings": 4096, "quantization_config": {"quant_method": method}}
    return model_folder(tmp_path, config, {})


def test_float32_for_a_quantized_model_is_refused(tmp_path: Path) -> None:
    folder = quantized_folder(tmp_path, "gptq")
    with pytest.raises(ModelError, match="dtype float32 with a quantized model"):
        engine_options("m", ModelConfig(source=str(folder), dtype="float32"), folder)
    engine_options("m", ModelConfig(source=str(folder), dtype="auto"), folder)


def test_a_draft_model_folder_that_is_not_there_is_refused(tmp_path: Path) -> None:
    """A mistyped folder went to vLLM as a Hugging Face id: a traceback, or a download."""
    folder = model_folder(tmp_path, {"max_position_embeddings": 4096}, {})
    draft = Speculative(method="draft_model", num_speculative_tokens=2, model="/models/draf")
    config = ModelConfig(source=str(folder), speculative=draft)
    with pytest.raises(ModelError, match=r"draft model /models/draf has no config\.json"):
        engine_options("m", config, folder)
    found = draft.model_copy(update={"model": str(folder)})
    engine_options("m", ModelConfig(source=str(folder), speculative=found), folder)


def test_every_setting_is_in_what_vllm_is_given(tmp_path: Path) -> None:
    """Only the tokenizer mode was checked in vLLM's arguments: a setting dropped there
    (the KV cache, the draft, the batch size) passed every test."""
    folder = model_folder(tmp_path, {"max_position_embeddings": 4096}, {})
    config = ModelConfig(
        source=str(folder),
        max_model_len=3000,
        max_num_seqs=7,
        kv_cache_mib=256,
        memory_share=0.5,
        quantization="fp8",
        speculative=Speculative(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4),
        enforce_eager=False,
    )
    options = replace(engine_options("m", config, folder), tensor_parallel_size=2)
    args = _engine_args(options, "bfloat16", "mp")
    assert (args.model, args.max_model_len, args.max_num_seqs) == (str(folder), 3000, 7)
    assert (args.dtype, args.quantization, args.tensor_parallel_size) == ("bfloat16", "fp8", 2)
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (256 * 2**20, 0.5)
    assert args.speculative_config == options.speculative and options.speculative
    assert (args.enforce_eager, args.distributed_executor_backend) == (False, "mp")
    assert args.enable_prefix_caching is True


def test_a_configuration_vllm_refuses_is_one_line_naming_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own refusals (raised as it builds its config) were a traceback through
    `tandoor worker`; `auto` reached vLLM resolved, as the log says."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from workers.dtype import resolve_dtype

    given: list[Any] = []

    def refuse(args: Any, **_: Any) -> NoReturn:
        given.append(args)
        raise ValueError("1 validation error for VllmConfig\n  Value error, no such thing [x]")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", refuse)
    folder = model_folder(tmp_path, {"max_position_embeddings": 4096}, {})
    options = engine_options("m", ModelConfig(source=str(folder)), folder)
    caplog.set_level(logging.INFO, logger="workers.engine")
    with pytest.raises(ModelError) as refused:
        asyncio.run(Engine.start(options))
    assert str(refused.value) == (
        "vLLM refuses this configuration: 1 validation error for VllmConfig "
        "Value error, no such thing [x]"
    )
    chosen = resolve_dtype("auto")
    assert given[0].dtype == chosen.dtype != "auto"
    assert f"engine dtype {chosen.dtype}: {chosen.reason}" in caplog.messages
