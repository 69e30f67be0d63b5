"""Every route but health needs an API key: `Authorization: Bearer <key>`."""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from producers.gateway.errors import UNREACHABLE, ApiError, error_response, store_unreachable
from producers.gateway.services import Services, services
from tandoor.policies.api_keys import Principal

UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


async def current_principal(
    request: Request, deps: Annotated[Services, Depends(services)]
) -> Principal:
    return await principal_of(request.headers.get("authorization", ""), deps)


async def principal_of(authorization: str, deps: Services) -> Principal:
    """The caller an Authorization header names; a 401 for a missing, bad or revoked key."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            kind="authentication_error",
            headers=UNAUTHORIZED,
            code="invalid_api_key",
        )
    principal = await deps.keys.resolve(key.strip())
    if principal is None:
        raise ApiError(
            401,
            "invalid or revoked API key",
            kind="authentication_error",
            headers=UNAUTHORIZED,
            code="invalid_api_key",
        )
    return principal


class KeyBeforeBody:
    """Pure ASGI middleware: on `paths` (uploads, whose bodies are large), the key is
    checked before the body is read. A route checks it only once FastAPI has parsed the
    whole body (a form: written to disk), so anyone could make a replica take 64 MiB."""

    def __init__(self, app: ASGIApp, paths: Collection[str]) -> None:
        self.app = app
        self.paths = set(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps = getattr(scope["app"].state, "services", None) if "app" in scope else None
        upload = scope["type"] == "http" and scope.get("method") == "POST"
        if upload and scope["path"] in self.paths and deps is not None:
            authorization = Headers(scope=scope).get("authorization", "")
            try:
                await principal_of(authorization, deps)
            except ApiError as refused:
                await error_response(refused)(scope, receive, send)
                return
            except UNREACHABLE as exc:  # out here, the app's handlers do not see it
                await error_response(store_unreachable(exc))(scope, receive, send)
                return
        await self.app(scope, receive, send)


Caller = Annotated[Principal, Depends(current_principal)]
