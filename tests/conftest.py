"""Shared fixtures. Servers are started by the test command (scripts/test.sh);
here a missing server is a failure with a clear message, never a skip."""

from __future__ import annotations

import uuid

import pytest

from tandoor.settings import Settings


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture
def unique() -> str:
    """A fresh suffix for topic, group and keyspace names: tests share nothing."""
    return uuid.uuid4().hex[:12]
