"""The API docs pages (Swagger UI, ReDoc) load scripts from a CDN on the origin where the
chat page keeps its key: a setting turns them off, and production's config does."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from producers.gateway.app import create_app
from tandoor.settings import Settings
from tests.unit.k8s_manifests import config_env, settings_from


def _paths(settings: Settings) -> set[str]:
    routes = create_app(settings).routes
    return {r.path for r in routes if isinstance(r, Route) and not isinstance(r, APIRoute)}


def test_the_docs_pages_are_served_by_default() -> None:
    assert {"/openapi.json", "/docs", "/redoc"} <= _paths(Settings())


def test_turned_off_only_the_spec_is_served() -> None:
    paths = _paths(Settings(gateway_api_docs=False))
    assert "/openapi.json" in paths
    assert not {"/docs", "/redoc", "/docs/oauth2-redirect"} & paths


def test_production_config_turns_the_docs_pages_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from(config_env(), monkeypatch).gateway_api_docs is False
