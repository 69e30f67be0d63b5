"""What an upload's form may hold besides its file, on a small app with the gateway's
middleware, error handlers and route class. The form's other fields are held in memory
(the file part goes to disk): one user's stalled uploads of 63 one-megabyte fields, or a
63 MB urlencoded form, each pinned that much of a replica."""

from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import APIRouter, FastAPI, File, Form, UploadFile

from producers.gateway.errors import install_error_handlers
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.middleware import UPLOADS, install_middleware
from tandoor.settings import Settings

SETTINGS = Settings(gateway_max_body_bytes=10_000, gateway_max_file_bytes=1_000_000)


def upload_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_middleware(app, SETTINGS)
    router = APIRouter(route_class=StrictJsonRoute)

    @router.post(UPLOADS)
    async def upload(
        file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict[str, int | str]:
        return {"bytes": len(await file.read()), "purpose": purpose}

    app.include_router(router)
    return app


async def post(**kwargs: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=upload_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        return await http.post(UPLOADS, **kwargs)  # type: ignore[arg-type]


def assert_refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


async def test_a_file_larger_than_the_bodies_of_other_routes_is_taken() -> None:
    response = await post(files={"file": ("in.jsonl", b"x" * 500_000)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    assert response.json() == {"bytes": 500_000, "purpose": "batch"}


async def test_a_large_field_beside_the_file_is_refused() -> None:
    fields = {"purpose": "batch", "note": "y" * 100_000}
    response = await post(files={"file": ("in.jsonl", b"x")}, data=fields)
    assert_refused(response, 400, "Part exceeded maximum size")


async def test_many_fields_beside_the_file_are_refused() -> None:
    fields = {"purpose": "batch", **{f"f{n}": "y" for n in range(40)}}
    response = await post(files={"file": ("in.jsonl", b"x")}, data=fields)
    assert_refused(response, 400, "Too many fields")


async def test_a_form_without_a_file_gets_the_limit_of_every_other_body() -> None:
    response = await post(data={"purpose": "batch", "note": "y" * 50_000})
    assert_refused(response, 413, "larger than 10000 bytes")
