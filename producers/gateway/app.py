"""`tandoor gateway`: the FastAPI application and its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from producers.gateway.chat.router import router as chat_router
from producers.gateway.conversations.router import router as conversations_router
from producers.gateway.errors import install_error_handlers
from producers.gateway.middleware import install_middleware
from producers.gateway.openai_api.router import router as openai_router
from producers.gateway.services import open_services
from producers.gateway.web_page import install_page
from tandoor.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_services(settings) as deps:
            app.state.services = deps
            yield

    app = FastAPI(title="Tandoor", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    install_middleware(app, settings)
    app.include_router(conversations_router)
    app.include_router(chat_router)
    app.include_router(openai_router)
    install_page(app)

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
