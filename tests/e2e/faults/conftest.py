"""The fault tests break the package's stack (tests/e2e/conftest.py) and mend it: every
test leaves the servers running and the roles serving, even when it failed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.e2e.stack import Stack, servers_back


@pytest.fixture(autouse=True)
async def healthy_servers(stack: Stack) -> AsyncIterator[None]:
    """Whatever a test stopped comes back before the next one, even when it failed; and
    a role that died outside any test (one gateway did, seconds after it was ready,
    while the engines loaded) is started again before the next test, saying so."""
    await stack.revive()
    yield
    await servers_back(stack.settings)
    await stack.revive()
    await stack.usable()
