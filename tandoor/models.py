"""What each served model is and how its engine runs: the one description that the gateway
(context budget, load shedding, the model list) and the workers (the engine) both read.

`TANDOOR_MODELS` is a JSON object from served name (what clients send as `model`, and
what names the prompt topic) to its configuration, for example

    {"smollm2": {},
     "llama-8b": {"source": "/models/llama-8b", "max_model_len": 8192,
                  "tensor_parallel_size": 2, "quantization": "fp8"}}

A JSON list of names is short for defaults, which only a bundled model can take. What
pydantic checks here holds everywhere; what needs the model's files (its config.json, the
template, the GPUs) is checked by the worker before the engine starts
(workers/model_check.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Executor = Literal["auto", "uni", "mp"]

# Models that ship in a Python package (workers/model_store.py prepares their folders),
# with the names the chat page's picker shows for them.
BUNDLED_MODELS = {
    "smollm2": "SmolLM2 135M Instruct",
    "gemma3": "Gemma 3 270M (pretrained)",
}
BUNDLED_PREFIX = "bundled:"
# Where each bundled model's folder is made, under the cache (versioned: a change of
# recipe converts again instead of reusing).
BUNDLED_FOLDERS = {
    "smollm2": "smollm2-135m-instruct-bf16-v1",
    "gemma3": "gemma3-270m-bf16-v1",
}


class Speculative(BaseModel):
    """Speculative decoding, handed to vLLM as its `speculative_config`. `ngram` proposes
    from the prompt itself (no second model); the others need a draft `model`."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    model: str | None = None  # a folder or Hugging Face id of the draft model
    prompt_lookup_min: int | None = Field(default=None, ge=1)  # ngram only
    prompt_lookup_max: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        needs_model = self.method in ("draft_model", "eagle", "eagle3")
        if needs_model and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a draft `model`")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' takes no `model`")
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "ngram" and lookup != (None, None):
            raise ValueError("prompt_lookup_min/max apply to the 'ngram' method only")
        if None not in lookup and lookup[0] > lookup[1]:  # type: ignore[operator]
            raise ValueError(f"prompt_lookup_min {lookup[0]} > prompt_lookup_max {lookup[1]}")
        return self

    def vllm_config(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ModelConfig(BaseModel):
    """One served model. Unknown keys are refused: a misspelt option must not be ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # "bundled:<name>" or a local Hugging Face folder (config.json, weights, tokenizer).
    source: str = ""
    # auto: bf16 where the hardware computes it natively, float32 on other CPUs
    # (workers/dtype.py).
    dtype: Dtype = "auto"
    # The engine's context length, and so the gateway's context budget for this model.
    max_model_len: int = Field(default=2048, ge=64)
    quantization: str | None = None  # a vLLM method ("fp8", "awq", "gptq", ...)
    tensor_parallel_size: int = Field(default=1, ge=1)
    # auto: the model runs in the engine-core process on a CPU (one process fewer to
    # start, faster decoding), vLLM's choice elsewhere (workers/executor.py).
    executor: Executor = "auto"
    speculative: Speculative | None = None
    # None: eager on a CPU, compiled with CUDA graphs on a GPU (workers/engine.py).
    enforce_eager: bool | None = None
    max_num_seqs: int = Field(default=32, ge=1)  # prompts in flight per worker
    # KV cache per worker, on each of its GPUs with tensor parallelism (vLLM's
    # kv_cache_memory_bytes is per GPU). SmolLM2: ~22.5 KiB a token in bf16, so 1 GiB is
    # ~46k tokens; twice that in float32 (~23k).
    # None sizes it from memory_share instead (the usual choice on a GPU), and so does a
    # config that sets memory_share but not this (_memory_share_sizes_the_cache).
    kv_cache_mib: int | None = Field(default=1024, ge=1)
    memory_share: float = Field(default=0.3, gt=0, le=1)  # vLLM's gpu_memory_utilization
    # A Jinja chat template file used instead of the one in the model's tokenizer.
    chat_template: Path | None = None
    # What the chat page's picker shows (the served name when unset; a bundled model
    # served under its own name gets its display name).
    display_name: str | None = Field(default=None, min_length=1, max_length=80)

    @model_validator(mode="before")
    @classmethod
    def _memory_share_sizes_the_cache(cls, data: Any) -> Any:
        """A memory_share given alone is what sizes the KV cache: the default 1 GiB
        overrode it (vLLM only notes so), and an engine that needed more then failed
        with advice to raise it, which changed nothing."""
        if isinstance(data, dict) and "memory_share" in data and "kv_cache_mib" not in data:
            return {**data, "kv_cache_mib": None}
        return data

    @model_validator(mode="after")
    def _one_process_one_engine(self) -> ModelConfig:
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"executor 'uni' runs one process: tensor_parallel_size "
                f"{self.tensor_parallel_size} needs 'mp' or 'auto'"
            )
        return self


def parse_models(raw: Any) -> Any:
    """TANDOOR_MODELS as pydantic receives it: a list of names becomes default configs,
    and a config without a source takes the bundled model of its name."""
    if isinstance(raw, list | tuple):
        raw = {name: {} for name in raw}
    if not isinstance(raw, dict):
        return raw  # pydantic reports the type error
    return {name: _with_source(name, config) for name, config in raw.items()}


def _with_source(name: str, config: Any) -> Any:
    if isinstance(config, ModelConfig):
        config = config.model_dump()
    if not isinstance(config, dict):
        return config
    source = config.get("source") or ""
    if not source:
        if name not in BUNDLED_MODELS:
            raise ValueError(
                f"model {name!r} needs a `source` (a Hugging Face folder); models that "
                f"need none are the bundled ones: {', '.join(BUNDLED_MODELS)}"
            )
        source = BUNDLED_PREFIX + name
    if source.startswith(BUNDLED_PREFIX):
        bundled = source[len(BUNDLED_PREFIX) :]
        if bundled not in BUNDLED_MODELS:
            raise ValueError(
                f"model {name!r}: {source!r} is not bundled; bundled models: "
                f"{', '.join(BUNDLED_PREFIX + m for m in BUNDLED_MODELS)}"
            )
        config = {**config, "display_name": config.get("display_name") or BUNDLED_MODELS[bundled]}
    return {**config, "source": source}


def tokenizer_file(config: ModelConfig, cache_dir: Path) -> Path:
    """Where the model's tokenizer.json is once its folder exists (a bundled model's is
    made by `tandoor prepare-model`, or by its first worker)."""
    if config.source.startswith(BUNDLED_PREFIX):
        folder = BUNDLED_FOLDERS[config.source.removeprefix(BUNDLED_PREFIX)]
        return cache_dir / "models" / folder / "tokenizer.json"
    return Path(config.source) / "tokenizer.json"
