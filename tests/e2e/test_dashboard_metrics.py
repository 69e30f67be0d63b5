"""The dashboards against the running stack: every metric a panel queries is on the
/metrics page of some role that is running (the unit test reads the roles' registries;
this reads what they serve), after a reply went through them."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import auth, chat, new_conversation
from tests.e2e.stack import Stack
from tests.ops import ops_get
from tests.unit.test_dashboards import SERIES_SUFFIXES, metric_names, queries

pytestmark = pytest.mark.integration


async def served(stack: Stack) -> set[str]:
    """Every series name the stack's roles serve, families without samples yet included."""
    names: set[str] = set()
    for role in stack.roles():
        response = await ops_get(role, "/metrics")
        assert response.status_code == 200, f"{role.name}: {response.status_code}"
        for family in text_string_to_metric_families(response.text):
            names |= {sample.name for sample in family.samples}
            names |= {family.name + s for s in SERIES_SUFFIXES.get(family.type, ("",))}
    return names


async def test_every_metric_a_panel_queries_is_served_by_a_running_role(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    await chat(http, headers, await new_conversation(http, headers), "Say hi.", 4)
    serving = await served(stack)
    queried = {(where, name) for where, expr in queries() for name in metric_names(expr)}
    assert queried, "the dashboards query nothing"
    missing = sorted(f"{where}: {name}" for where, name in queried if name not in serving)
    assert not missing, "queried, served by no running role:\n" + "\n".join(missing)
