"""`tandoor gateway`: the FastAPI application and its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from producers.gateway.batches.router import router as batches_router
from producers.gateway.chat.router import router as chat_router
from producers.gateway.conversations.router import router as conversations_router
from producers.gateway.errors import install_error_handlers
from producers.gateway.metrics import gateway_metrics
from producers.gateway.middleware import install_middleware
from producers.gateway.openai_api.router import router as openai_router
from producers.gateway.services import READY_WITHOUT, Services, open_services
from producers.gateway.streaming import StreamSlots
from producers.gateway.usage import router as usage_router
from producers.gateway.web_page import install_page
from tandoor.ops import OpsServer, readiness_body, run_checks
from tandoor.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    slots = StreamSlots(settings.gateway_max_streams, settings.gateway_resumes_per_user)

    def current() -> Services | None:
        return getattr(app.state, "services", None)

    async def readiness() -> dict[str, bool]:
        deps = current()
        return await deps.readiness() if deps else {"started": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Served first: liveness answers while the services connect (not ready yet).
        ops = OpsServer("gateway", registry, readiness, READY_WITHOUT)
        await ops.start(settings.host, settings.gateway_metrics_port)
        try:
            async with open_services(settings, slots) as deps:
                app.state.services = deps
                yield
        finally:
            await ops.close()

    docs = settings.gateway_api_docs
    app = FastAPI(
        title="Tandoor",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.slots = slots  # the server sets it draining at SIGTERM
    registry = gateway_metrics(app, slots, current)
    install_error_handlers(app)
    install_middleware(app, settings)
    app.include_router(conversations_router)
    app.include_router(chat_router)
    app.include_router(openai_router)
    app.include_router(batches_router)
    app.include_router(usage_router)
    install_page(app)

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready", tags=["health"])
    async def ready() -> JSONResponse:
        """Readiness: Cassandra and Kafka usable, and not shutting down (Redis is shown:
        without it the paid tiers are still served)."""
        ok, results = await run_checks(readiness, READY_WITHOUT)
        return JSONResponse(readiness_body("gateway", ok, results), status_code=200 if ok else 503)

    return app
