"""Per-model configuration: one description, checked at start with errors that say what to
change (tandoor/models.py, workers/model_check.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from tandoor.cli import app
from tandoor.models import ModelConfig, Speculative
from tandoor.settings import Settings, get_settings
from workers.model_check import ModelError, engine_options, prepare_engine


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return tmp_path


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_the_default_serves_both_bundled_models() -> None:
    assert {n: c.source for n, c in Settings().models.items()} == {
        "smollm2": "bundled:smollm2",
        "gemma3": "bundled:gemma3",
    }


def test_display_names_come_from_the_config_or_the_bundle(folder: Path) -> None:
    configs = {
        "smollm2": {},
        "alias": {"source": "bundled:gemma3"},
        "named": {"source": "bundled:gemma3", "display_name": "Ours"},
        "local": {"source": str(folder)},
    }
    models = Settings.model_validate({"models": configs}).models
    assert {name: config.display_name for name, config in models.items()} == {
        "smollm2": "SmolLM2 135M Instruct",
        "alias": "Gemma 3 270M (pretrained)",
        "named": "Ours",
        "local": None,  # the model list shows its served name
    }
    with pytest.raises(ValidationError, match="display_name"):
        ModelConfig(source=str(folder), display_name="")


def test_every_bundled_name_has_a_recipe() -> None:
    from tandoor.models import BUNDLED_MODELS
    from workers.model_store import BUNDLED

    assert set(BUNDLED) == set(BUNDLED_MODELS)


def test_a_list_of_names_serves_bundled_models_with_defaults() -> None:
    settings = Settings.model_validate({"models": ["smollm2"]})
    config = settings.models["smollm2"]
    assert config.source == "bundled:smollm2"
    assert (config.max_model_len, config.max_num_seqs, config.dtype) == (2048, 32, "auto")


@pytest.mark.parametrize(
    ("models", "complaint"),
    [
        (["llama"], "model 'llama' needs a `source`"),
        ({"x": {"source": "bundled:gpt5"}}, "'bundled:gpt5' is not bundled"),
        ({"smollm2": {"max_model_len": 10}}, "greater than or equal to 64"),
        ({"smollm2": {"max_num_seq": 8}}, "max_num_seq\n  Extra inputs are not permitted"),
        ({"smollm2": {"dtype": "fp8"}}, "'auto', 'bfloat16', 'float16' or 'float32'"),
        ({"smollm2": {"tensor_parallel_size": 0}}, "greater than or equal to 1"),
        ({"smollm2": {"executor": "ray"}}, "'auto', 'uni' or 'mp'"),
        ({"x": {"source": "/m", "executor": "uni", "tensor_parallel_size": 2}}, "needs 'mp'"),
        ({}, "at least 1 item"),
        ("smollm2", "valid dictionary"),
    ],
)
def test_a_bad_model_configuration_is_refused_with_its_reason(
    models: object, complaint: str
) -> None:
    with pytest.raises(ValidationError, match=complaint):
        Settings.model_validate({"models": models})


@pytest.mark.parametrize(
    ("speculative", "complaint"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "needs a draft `model`"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "/d"}, "takes no `model`"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "greater than or equal to 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
             "prompt_lookup_max": 2},
            "prompt_lookup_min 5 > prompt_lookup_max 2",
        ),
        ({"method": "medusa-ish", "num_speculative_tokens": 2}, "Input should be"),
    ],
)  # fmt: skip
def test_bad_speculative_decoding_is_refused(speculative: object, complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        Speculative.model_validate(speculative)


def test_every_option_reaches_the_engine(folder: Path) -> None:
    template = folder / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = ModelConfig(
        source=str(folder),
        dtype="float32",
        max_model_len=3000,
        max_num_seqs=7,
        kv_cache_mib=256,
        memory_share=0.5,
        speculative=Speculative(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4),
        chat_template=template,
        enforce_eager=False,
    )
    options = engine_options("m", config, folder)
    assert options.enforce_eager is False
    assert options.model_dir == folder
    assert (options.max_model_len, options.max_num_seqs, options.dtype) == (3000, 7, "float32")
    assert options.kv_cache_memory_bytes == 256 * 1024 * 1024
    assert options.gpu_memory_utilization == 0.5
    assert options.speculative == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    assert options.chat_template == template.read_text()
    assert (options.quantization, options.tensor_parallel_size) == (None, 1)


def test_the_engine_reads_the_hugging_face_tokenizer_the_gateway_counts_with(
    folder: Path,
) -> None:
    """vLLM's "auto" takes its Mistral tokenizer for a folder with tekken.json: prompts
    rendered as text then encoded with no control tokens, and the chat-template
    override was ignored."""
    from workers.engine import _engine_args

    args = _engine_args(engine_options("m", ModelConfig(source=str(folder)), folder), "bf16", None)
    assert args.tokenizer_mode == "hf"


def test_a_window_longer_than_the_model_is_refused(folder: Path) -> None:
    config = ModelConfig(source=str(folder), max_model_len=8192)
    with pytest.raises(ModelError, match="max_model_len 8192 is longer than the model's 4096"):
        engine_options("m", config, folder)


@pytest.mark.parametrize(
    ("config", "longest"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 4}}, 16384),
        ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}, 16384),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 8192),
        # transformers 5, per layer type
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0}}}, 16384),
        ({"rope_parameters": {"rope_type": "default"}}, 4096),
        # Stretched in max_position_embeddings already: vLLM applies no factor (any
        # scaling skipped the check, and vLLM refused the window with a traceback).
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, 4096),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, 4096),
        ({"rope_scaling": {"type": "longrope", "factor": 4}}, 4096),
        ({"model_type": "gemma3", "rope_scaling": {"rope_type": "linear", "factor": 8}}, 4096),
    ],
)
def test_the_window_a_rope_scaling_allows_is_the_one_vllm_allows(
    folder: Path, config: dict[str, Any], longest: int
) -> None:
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, **config}))
    engine_options("m", ModelConfig(source=str(folder), max_model_len=longest), folder)
    with pytest.raises(ModelError, match=f"longer than the model's {longest} positions"):
        engine_options("m", ModelConfig(source=str(folder), max_model_len=longest + 1), folder)


def test_eager_by_default_on_a_cpu_and_compiled_on_a_gpu(folder: Path) -> None:
    """Hard-wired eager: every GPU worker decoded without CUDA graphs."""
    from workers.engine import choose_eager

    assert choose_eager(None, on_cpu=True) and not choose_eager(None, on_cpu=False)
    assert not choose_eager(False, on_cpu=True) and choose_eager(True, on_cpu=False)
    assert engine_options("m", ModelConfig(source=str(folder)), folder).enforce_eager is None


def test_a_token_budget_past_the_kv_cache_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The budget (40,000) admitted more than a float32 cache of 1 GiB holds (~23k
    tokens of SmolLM2), and nothing said so: the engine preempted and recomputed."""
    from workers.model_check import check_cache

    check_cache("m", 40_000, 23_301)
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "40000 is more than its KV cache holds (23301 tokens)" in said
    caplog.clear()
    check_cache("m", 40_000, 46_603)
    check_cache("m", 40_000, None)  # the engine did not say
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_quantized_model_is_known_by_its_setting_or_its_config(folder: Path) -> None:
    """dtype auto needs to know (16 bits only: workers/dtype.py)."""
    assert not engine_options("m", ModelConfig(source=str(folder)), folder).quantized
    awq = ModelConfig(source=str(folder), quantization="awq")
    assert engine_options("m", awq, folder).quantized
    quantized = {"max_position_embeddings": 4096, "quantization_config": {"quant_method": "gptq"}}
    (folder / "config.json").write_text(json.dumps(quantized))
    assert engine_options("m", ModelConfig(source=str(folder)), folder).quantized


def test_a_memory_share_given_alone_sizes_the_kv_cache(folder: Path) -> None:
    """The default 1 GiB cache overrode it: an 8B model on an 80 GB card failed to start
    with advice to raise the share, or ran on 1 GiB of cache."""
    shared = engine_options("m", ModelConfig(source=str(folder), memory_share=0.9), folder)
    assert (shared.kv_cache_memory_bytes, shared.gpu_memory_utilization) == (None, 0.9)
    raw: Any = {"m": {"source": str(folder), "memory_share": 0.9}}  # as TANDOOR_MODELS
    from_env = Settings(models=raw)
    assert from_env.models["m"].kv_cache_mib is None
    both = ModelConfig(source=str(folder), memory_share=0.9, kv_cache_mib=512)
    assert both.kv_cache_mib == 512  # an exact size, where both are given
    assert ModelConfig(source=str(folder)).kv_cache_mib == 1024


def test_a_window_longer_than_the_workers_token_budget_is_said_at_start(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt that long reserves more than the worker admits at once: it waits for an
    idle worker, and under load expires unanswered, with nothing said anywhere."""
    config = ModelConfig(source=str(folder), max_model_len=4096)
    settings = Settings(models={"m": config}, worker_max_tokens=3000)
    prepare_engine(settings, "m")
    assert "TANDOOR_WORKER_MAX_TOKENS 3000 is less than its max_model_len 4096" in caplog.text
    caplog.clear()
    prepare_engine(settings.model_copy(update={"worker_max_tokens": 4096}), "m")
    assert "TANDOOR_WORKER_MAX_TOKENS" not in caplog.text


def test_a_broken_chat_template_is_refused_with_its_line(folder: Path) -> None:
    template = folder / "chat.jinja"
    template.write_text("hello\n{% for m in messages %}{{ m.content }\n")
    config = ModelConfig(source=str(folder), chat_template=template)
    with pytest.raises(ModelError, match=r"chat\.jinja line 2"):
        engine_options("m", config, folder)
    missing = ModelConfig(source=str(folder), chat_template=folder / "nope.jinja")
    with pytest.raises(ModelError, match="cannot read chat_template"):
        engine_options("m", missing, folder)


def test_an_unknown_quantization_is_refused_with_the_known_ones(folder: Path) -> None:
    config = ModelConfig(source=str(folder), quantization="fp9")
    with pytest.raises(ModelError, match=r"quantization 'fp9' is not one vLLM knows: .*fp8"):
        engine_options("m", config, folder)


def test_tensor_parallelism_needs_as_many_gpus(folder: Path) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = max(2, gpus + 1)
    config = ModelConfig(source=str(folder), tensor_parallel_size=wanted)
    with pytest.raises(ModelError, match=f"needs {wanted} GPUs; this machine has {gpus}"):
        engine_options("m", config, folder)


def test_a_model_folder_without_config_is_refused(tmp_path: Path) -> None:
    settings = Settings.model_validate({"models": {"x": {"source": str(tmp_path / "none")}}})
    with pytest.raises(ModelError, match=r"none has no config\.json"):
        prepare_engine(settings, "x")
    with pytest.raises(ModelError, match="'y' is not in TANDOOR_MODELS: x"):
        prepare_engine(settings, "y")


def test_the_command_line_reports_a_configuration_error_in_one_line_each(
    monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    monkeypatch.setenv("TANDOOR_MODELS", '{"smollm2": {"max_model_len": 8, "speculatve": {}}}')
    result = CliRunner().invoke(app, ["worker", "--model", "smollm2"])
    assert result.exit_code == 2
    assert "models.smollm2.max_model_len: Input should be greater than or equal to 64" in (
        result.output
    )
    assert "models.smollm2.speculatve: Extra inputs are not permitted" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("variable", "value", "complaint"),
    [
        ("TANDOOR_MODELS", "{'smollm2': {}}", "Expecting property name enclosed in double quotes"),
        ("TANDOOR_TIERS", "[", 'error parsing value for field "tiers"'),
        ("TANDOOR_MODELS", '{"org/model": {"source": "/m"}}', "'org/model' is not a valid topic"),
        ("TANDOOR_MODELS", json.dumps({"m" * 201: {"source": "/m"}}), "1 to 200"),
        ("TANDOOR_KEYSPACE", "tandoor-test", "keyspace: String should match pattern"),
    ],
)
def test_settings_that_are_not_json_or_name_no_valid_topic_or_keyspace_are_one_line(
    monkeypatch: pytest.MonkeyPatch, fresh_settings: None, variable: str, value: str, complaint: str
) -> None:
    """Each was a traceback: unparsable JSON at any command, a model name Kafka cannot
    take as a topic, a keyspace CQL cannot name, at bootstrap."""
    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(app, ["infra", "status"])
    assert result.exit_code == 2, result.output
    assert complaint in result.output
    assert "Traceback" not in result.output
