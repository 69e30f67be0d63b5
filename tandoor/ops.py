"""A role's operations endpoint on a port of its own, served from the role's event loop:
`/metrics` (Prometheus), `/health` (the process and its loop answer: liveness) and
`/ready` (its dependencies are usable and it is not draining: readiness).

Served from the role's loop on purpose: a loop that is stuck stops answering /health,
which is what a liveness probe should notice."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Checks = Callable[[], Awaitable[dict[str, bool]]]  # dependency name -> usable
CHECK_TIMEOUT_S = 2.0


async def run_checks(
    checks: Checks, reported_only: Collection[str] = ()
) -> tuple[bool, dict[str, bool]]:
    """All checks, each failing (not hanging) when a dependency does not answer. Those
    `reported_only` are shown but do not make the role unready (it serves without them)."""
    try:
        results = await asyncio.wait_for(checks(), CHECK_TIMEOUT_S)
    except Exception as exc:  # a check that raises is a dependency that is not usable
        log.warning("readiness check failed: %r", exc)
        return False, {"checks": False}
    return all(ok for name, ok in results.items() if name not in reported_only), results


def readiness_body(role: str, ready: bool, results: dict[str, bool]) -> dict[str, object]:
    return {"role": role, "status": "ready" if ready else "not ready", "checks": results}


class OpsServer:
    def __init__(
        self,
        role: str,
        registry: CollectorRegistry,
        checks: Checks,
        reported_only: Collection[str] = (),
    ) -> None:
        self.role = role
        self._registry = registry
        self._checks = checks
        self._reported_only = reported_only
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0 picks a free port); return the port and log the address."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # one line, at start, not a traceback
            raise SystemExit(
                f"{self.role}: cannot serve /metrics, /health and /ready on {host} port "
                f"{port}: {exc.strerror or exc} (the role's *_METRICS_PORT or "
                "STREAMS_WEB_PORT setting; 0 picks a free one)"
            ) from None
        bound = int(self._runner.addresses[0][1])
        log.info("%s metrics on http://%s:%d/metrics", self.role, host, bound)
        return bound

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "status": "ok"})

    async def _ready(self, _: web.Request) -> web.Response:
        ready, results = await run_checks(self._checks, self._reported_only)
        body = readiness_body(self.role, ready, results)
        return web.json_response(body, status=200 if ready else 503)
