from __future__ import annotations

from pathlib import Path

import pytest
from cassandra import ConsistencyLevel
from pydantic import ValidationError

from infra.topics import declared_topics
from schemas import topics
from tandoor.clients import cassandra_cluster
from tandoor.models import ModelConfig
from tandoor.settings import Band, Settings


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDOOR_KAFKA_PORT", "29092")
    monkeypatch.setenv(
        "TANDOOR_MODELS", '{"smollm2": {}, "gemma3": {"source": "/m/g", "max_model_len": 8192}}'
    )
    settings = Settings()
    assert settings.kafka_bootstrap == "127.0.0.1:29092"
    assert settings.served_models == ["smollm2", "gemma3"]
    assert settings.models["smollm2"].source == "bundled:smollm2"
    assert settings.models["gemma3"].max_model_len == 8192


def test_duplicate_band_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="unique"):
        Settings(bands=[Band(name="a", partitions=1), Band(name="a", partitions=2)])


def test_every_model_gets_a_prompt_topic_with_all_band_partitions() -> None:
    settings = Settings(
        models={name: ModelConfig(source=f"/models/{name}") for name in ("smollm2", "gemma3")},
        bands=[Band(name="paid", partitions=3), Band(name="free", partitions=5)],
        tiers={},
    )
    specs = {spec.name: spec for spec in declared_topics(settings)}
    assert specs["prompts.smollm2"].partitions == 8
    assert specs["prompts.gemma3"].partitions == 8
    assert {topics.TOKENS, topics.CONTROL, topics.USAGE, topics.DEAD_LETTER} <= set(specs)


def test_a_tier_must_use_a_declared_band() -> None:
    with pytest.raises(ValidationError, match="tier 'free' uses band 'interactive-free'"):
        Settings(bands=[Band(name="only", partitions=2)])


def test_cassandra_reads_and_writes_at_a_quorum() -> None:
    """The deployed keyspaces keep 3 replicas: at the driver's LOCAL_ONE a read could
    miss a write that one replica had taken (a batch created, then 404)."""
    cluster = cassandra_cluster(Settings())
    assert cluster.profile_manager.default.consistency_level == ConsistencyLevel.LOCAL_QUORUM


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("TANDOOR_GATEWAY_DRAIN", "did you mean TANDOOR_GATEWAY_DRAIN_S?"),
        ("TANDOOR_KAFKA_BOOTSTRAP", "no such setting"),  # a name other tools use
        ("tandoor_redis_prot", "did you mean TANDOOR_REDIS_PORT?"),
    ],
)
def test_a_misspelt_setting_is_refused_with_the_one_meant(
    monkeypatch: pytest.MonkeyPatch, name: str, hint: str
) -> None:
    """Ignored: the drain stayed 30 s, the port its default, and nothing said so."""
    monkeypatch.setenv(name, "90")
    with pytest.raises(ValidationError, match="no such setting") as refused:
        Settings()
    assert name.upper() in str(refused.value) and hint in str(refused.value)


def test_a_part_of_a_setting_is_refused_with_the_whole_one_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read as a nested setting, it replaced the whole default: the second bundled model
    was no longer served, and its conversations were a 404, without a word."""
    monkeypatch.setenv("TANDOOR_MODELS__SMOLLM2__MAX_MODEL_LEN", "4096")
    with pytest.raises(ValidationError, match="set TANDOOR_MODELS as one JSON value"):
        Settings()


def test_variables_of_the_other_tools_are_not_settings_and_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("TANDOOR_API_KEY", "TANDOOR_API_URL", "TANDOOR_ENGINE", "TANDOOR_TEST_SEED"):
        monkeypatch.setenv(name, "1")
    Settings()  # not refused


@pytest.mark.parametrize("port", ["kafka_port", "gateway_port", "worker_metrics_port"])
@pytest.mark.parametrize("value", [-1, 70_000])
def test_a_port_outside_the_range_is_refused(port: str, value: int) -> None:
    with pytest.raises(ValidationError, match=port):
        Settings.model_validate({port: value})


def test_two_settings_naming_one_port_are_refused_with_both_names() -> None:
    with pytest.raises(ValidationError, match="port must be used once") as refused:
        Settings(redis_port=7777, gateway_metrics_port=7777)
    assert "'redis_port', 'gateway_metrics_port'" in str(refused.value)


@pytest.mark.parametrize("port", ["kafka_port", "cassandra_port", "redis_port", "gateway_port"])
def test_a_servers_port_is_never_zero(port: str) -> None:
    """Accepted, redis-server opened no port (`--port 0`), infra up waited its 180 s for
    one, and the main job printed the chat page at http://127.0.0.1:0/."""
    with pytest.raises(ValidationError, match=port):
        Settings.model_validate({port: 0})


def test_ports_left_to_pick_free_ones_may_both_be_zero() -> None:
    Settings(worker_metrics_port=0, gateway_metrics_port=0)  # not refused


def test_a_relative_home_is_taken_from_the_folder_it_was_given_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The servers start in their own folders: a relative home named a folder inside each."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TANDOOR_HOME", ".tandoor/mine")
    monkeypatch.setenv("TANDOOR_CACHE_DIR", "~/cache")
    settings = Settings()
    assert settings.home == tmp_path / ".tandoor" / "mine"
    assert settings.cache_dir == Path.home() / "cache"
