"""A model's configuration checked against its files and this machine before the engine
starts, so that a mistake is one clear line instead of a vLLM traceback minutes later."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tandoor.models import ModelConfig, Speculative
from tandoor.settings import Settings
from workers.engine import EngineOptions
from workers.engine import ModelError as ModelError  # raised here, caught by its callers
from workers.model_store import resolve_model_dir

log = logging.getLogger(__name__)

# config.json keys that bound the context length, by model family, as vLLM reads them:
# the smallest of those given, unless model_max_length (Command-R) overrides it.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def prepare_engine(settings: Settings, name: str) -> EngineOptions:
    """The engine options of served model `name`, its folder prepared (a bundled model is
    converted on first use) and its configuration checked."""
    config = settings.models.get(name)
    if config is None:
        raise ModelError(f"model {name!r} is not in TANDOOR_MODELS: {', '.join(settings.models)}")
    try:
        model_dir = resolve_model_dir(name, settings)
    except (ValueError, FileNotFoundError) as exc:  # FileNotFoundError: its package missing
        raise ModelError(str(exc)) from exc
    _check_budget(name, config.max_model_len, settings.worker_max_tokens)
    return engine_options(name, config, model_dir)


def _check_budget(name: str, max_model_len: int, worker_max_tokens: int) -> None:
    """Said at start: a prompt as long as the window reserves more than the worker's
    token budget, so it waits for an idle worker, and under load expires unanswered.
    Not refused: a budget below the window is a choice (prompts that long are rare)."""
    if worker_max_tokens < max_model_len:
        log.warning(
            "model %r: TANDOOR_WORKER_MAX_TOKENS %d is less than its max_model_len %d: a "
            "prompt that long waits for an idle worker; set it to at least %d",
            name,
            worker_max_tokens,
            max_model_len,
            max_model_len,
        )


def check_cache(name: str, worker_max_tokens: int, cache_tokens: int | None) -> None:
    """Said once the engine has sized its KV cache: a token budget past what it holds
    admits more than fits, and the engine preempts replies and computes them again, on
    the cores it is short of (1 GiB holds ~46k tokens of SmolLM2 in bf16, ~23k in the
    float32 that `auto` takes on a CPU without bf16, against a budget of 40,000)."""
    if cache_tokens is None:
        return
    log.info("model %r: the KV cache holds %d tokens", name, cache_tokens)
    if worker_max_tokens > cache_tokens:
        log.warning(
            "model %r: TANDOOR_WORKER_MAX_TOKENS %d is more than its KV cache holds (%d "
            "tokens): when it fills, the engine preempts replies and computes them again; "
            "raise its kv_cache_mib or lower the budget",
            name,
            worker_max_tokens,
            cache_tokens,
        )


def engine_options(name: str, config: ModelConfig, model_dir: Path) -> EngineOptions:
    """The engine's options for model `name` served from `model_dir`, once its
    configuration is checked against the folder and this machine."""
    hf_config = _hf_config(name, model_dir)
    _check_length(name, config.max_model_len, hf_config, _tokenizer_limit(model_dir))
    _check_quantization(name, config, hf_config)
    _check_parallelism(name, config.tensor_parallel_size)
    _check_draft(name, config.speculative)
    kv_mib = config.kv_cache_mib
    return EngineOptions(
        model_dir=model_dir,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        dtype=config.dtype,
        gpu_memory_utilization=config.memory_share,
        kv_cache_memory_bytes=None if kv_mib is None else kv_mib * 1024 * 1024,
        quantization=config.quantization,
        quantized=config.quantization is not None or _checkpoint_quantization(hf_config) != "",
        tensor_parallel_size=config.tensor_parallel_size,
        executor=config.executor,
        speculative=None if config.speculative is None else config.speculative.vllm_config(),
        enforce_eager=config.enforce_eager,
        chat_template=_chat_template(name, config.chat_template),
    )


def _hf_config(name: str, model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"model {name!r}: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"model {name!r}: {path} is not a JSON object")
    return config


def _tokenizer_limit(model_dir: Path) -> int | None:
    """tokenizer_config.json's model_max_length, which vLLM takes as a cap too (most
    tokenizers write a "no limit" of 1e30 there)."""
    try:
        limit = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = limit.get("model_max_length") if isinstance(limit, dict) else None
    return found if isinstance(found, int) else None


def _check_length(
    name: str, max_model_len: int, hf_config: dict[str, Any], tokenizer_limit: int | None
) -> None:
    text_config = hf_config.get("text_config") or hf_config  # multimodal models nest it
    limits = [text_config[k] for k in _LENGTH_KEYS if isinstance(text_config.get(k), int)]
    if not limits:
        return
    override = text_config.get("model_max_length")
    derived = override if isinstance(override, int) and override else min(limits)
    if tokenizer_limit:
        derived = min(derived, tokenizer_limit)
    longest = int(derived * _rope_factor(hf_config, text_config))
    if max_model_len > longest:
        raise ModelError(
            f"model {name!r}: max_model_len {max_model_len} is longer than the model's "
            f"{longest} positions; set max_model_len to at most {longest}"
        )


# RoPE types whose max_position_embeddings is the stretched length already (vLLM's rule).
_STRETCHED_ALREADY = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


def _rope_factor(hf_config: dict[str, Any], text_config: dict[str, Any]) -> float:
    """How far RoPE scaling stretches the positions, as vLLM reads it: by `factor`, but
    not for the types that count it in already, nor for Gemma 3. Any scaling skipped the
    check: Llama 3.x, Qwen and the like (yarn, llama3) then failed in vLLM at start, with
    a traceback, on a window too long."""
    families = f"{hf_config.get('model_type', '')} {text_config.get('model_type', '')}"
    if "gemma3" in families:
        return 1.0
    factor = 1.0
    for params in _rope_parameters(text_config):
        if (params.get("rope_type") or params.get("type")) not in _STRETCHED_ALREADY:
            factor = params.get("factor", factor)
    return float(factor or 1.0)  # a null factor: vLLM takes 1


def _rope_parameters(text_config: dict[str, Any]) -> list[dict[str, Any]]:
    """`rope_scaling`, or transformers 5's `rope_parameters` (written for every model;
    per layer type in some)."""
    found = text_config.get("rope_scaling") or text_config.get("rope_parameters")
    if not isinstance(found, dict):
        return []
    nested = [v for v in found.values() if isinstance(v, dict)]
    return nested or [found]


def _checkpoint_quantization(hf_config: dict[str, Any]) -> str:
    """The method the checkpoint is quantized with ("" for none)."""
    found = hf_config.get("quantization_config")
    if not isinstance(found, dict):
        return ""
    return str(found.get("quant_method") or "unknown")


def _check_quantization(name: str, config: ModelConfig, hf_config: dict[str, Any]) -> None:
    """A method vLLM does not know, or float32 where the method's kernels take none.
    A method other than the checkpoint's is vLLM's to judge (it maps some onto others,
    gptq onto gptq_marlin): its refusal comes as one line from Engine.start."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    method = config.quantization or _checkpoint_quantization(hf_config)
    if config.quantization is not None and method not in QUANTIZATION_METHODS:
        raise ModelError(
            f"model {name!r}: quantization {method!r} is not one vLLM knows: "
            f"{', '.join(sorted(QUANTIZATION_METHODS))}"
        )
    if config.dtype != "float32" or method not in QUANTIZATION_METHODS:
        return
    try:  # a classmethod for most methods; the others need their config to say
        supported = get_quantization_config(method).get_supported_act_dtypes()
    except TypeError:
        return
    if all(str(dtype) != "torch.float32" for dtype in supported):
        takes = ", ".join(str(dtype).removeprefix("torch.") for dtype in supported)
        raise ModelError(
            f"model {name!r}: dtype float32 with a quantized model: {method}'s kernels "
            f"take {takes}; set dtype to auto"
        )


def _check_draft(name: str, speculative: Speculative | None) -> None:
    """A draft model named by a path must be a model folder; anything else is taken for
    a Hugging Face id, which vLLM downloads (or fails to, with a traceback)."""
    draft = speculative.model if speculative is not None else None
    if draft and draft.startswith(("/", ".", "~")):
        if not (Path(draft).expanduser() / "config.json").is_file():
            raise ModelError(
                f"model {name!r}: speculative decoding's draft model {draft} has no "
                "config.json: give the folder of a Hugging Face model"
            )


def _check_parallelism(name: str, size: int) -> None:
    if size == 1:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < size:
        raise ModelError(
            f"model {name!r}: tensor_parallel_size {size} needs {size} GPUs; "
            f"this machine has {gpus}"
        )


def _chat_template(name: str, path: Path | None) -> str | None:
    if path is None:
        return None
    import jinja2

    try:
        text = path.read_text(encoding="utf-8")
        jinja2.Environment().parse(text)
    except OSError as exc:
        raise ModelError(f"model {name!r}: cannot read chat_template {path}: {exc}") from exc
    except jinja2.TemplateSyntaxError as exc:
        raise ModelError(
            f"model {name!r}: chat_template {path} line {exc.lineno}: {exc.message}"
        ) from exc
    return text
