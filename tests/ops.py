"""Reading a role's ops port from tests: /metrics, /health and /ready."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infra.roles import RoleProcess


async def ops_get(role: RoleProcess, path: str) -> httpx.Response:
    """GET on the role's ops port (/metrics, /health, /ready)."""
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(f"http://127.0.0.1:{role.ops_port()}{path}")


async def samples(role: RoleProcess, **labels: str) -> dict[str, float]:
    """Each metric sample of the role, by name, summed over the samples whose labels
    include `labels`."""
    response = await ops_get(role, "/metrics")
    assert response.status_code == 200, response.text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if labels.items() <= sample.labels.items():
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
