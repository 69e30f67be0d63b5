"""Every route but health needs an API key: `Authorization: Bearer <key>`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from producers.gateway.errors import ApiError
from producers.gateway.services import Services, services
from tandoor.policies.api_keys import Principal

UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


async def current_principal(
    request: Request, deps: Annotated[Services, Depends(services)]
) -> Principal:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
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


Caller = Annotated[Principal, Depends(current_principal)]
