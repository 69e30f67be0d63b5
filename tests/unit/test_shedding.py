"""Which model answers: the asked one, or its fallback while its backlog is too long."""

from __future__ import annotations

from producers.gateway.shedding import ModelRouter
from tandoor.settings import Fallback, Settings


def router(backlog: dict[str, int]) -> ModelRouter:
    settings = Settings(
        models=["big", "small"],
        fallbacks={"big": Fallback(model="small", backlog=10, tiers=["free"])},
    )
    return ModelRouter(settings, backlog.get)


def test_a_listed_tier_is_shed_once_the_backlog_reaches_the_threshold() -> None:
    assert router({"big": 9}).answering("big", "free") == "big"
    assert router({"big": 10}).answering("big", "free") == "small"


def test_other_tiers_and_models_are_never_shed() -> None:
    assert router({"big": 500}).answering("big", "plus") == "big"
    assert router({"big": 500}).answering("small", "free") == "small"


def test_an_unknown_backlog_does_not_shed() -> None:
    assert router({}).answering("big", "free") == "big"


def test_a_fallback_to_an_unserved_model_is_refused() -> None:
    try:
        Settings(models=["big"], fallbacks={"big": Fallback(model="tiny", backlog=1, tiers=[])})
    except ValueError as exc:
        assert "tiny" in str(exc)
    else:
        raise AssertionError("accepted a fallback nobody serves")
