"""Routes of OpenAI's Files and Batches API: what the official client calls for
`client.files.*` and `client.batches.*`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile

from producers.gateway.auth import Caller
from producers.gateway.batches.service import BatchService, CreateBatch
from producers.gateway.batches.store import CHUNK_BYTES, Order
from producers.gateway.errors import ApiError
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.services import Services, services
from producers.gateway.timed_stream import TimedStream

router = APIRouter(prefix="/v1", tags=["batches"], route_class=StrictJsonRoute)


def batch_service(deps: Annotated[Services, Depends(services)]) -> BatchService:
    return deps.batches


Batches = Annotated[BatchService, Depends(batch_service)]


@router.post("/files")
async def upload_file(
    caller: Caller,
    svc: Batches,
    deps: Annotated[Services, Depends(services)],
    file: Annotated[UploadFile, File(description="JSONL, one request per line")],
    purpose: Annotated[str, Form()],
    expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[str | None, Form(alias="expires_after[seconds]")] = None,
) -> dict[str, Any]:
    if expires_anchor is not None or expires_seconds is not None:  # the SDK's expires_after
        # Refused by name: dropped as an unknown field, a file meant to expire was kept
        # for good, until the user's file cap refused every upload.
        raise ApiError(
            400,
            "expires_after is not supported: a file is kept until it is deleted",
            param="expires_after",
        )
    limit = deps.settings.gateway_max_file_bytes
    if file.size is not None and file.size > limit:
        raise ApiError(413, f"the file is {file.size} bytes: at most {limit}", param="file")
    name = file.filename or "upload.jsonl"
    return await svc.upload(caller, name, purpose, read_in_chunks(file), file.size)


@router.get("/files")
async def list_files(
    caller: Caller,
    svc: Batches,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Order, Query()] = "desc",
    after: Annotated[str | None, Query(max_length=200)] = None,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    return await svc.list_files(caller, limit, order, after, purpose)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, caller: Caller, svc: Batches) -> dict[str, Any]:
    return await svc.file(caller, file_id)


async def read_in_chunks(file: UploadFile) -> AsyncIterator[bytes]:
    """The upload (spooled to disk by the multipart parser) a chunk at a time."""
    while chunk := await file.read(CHUNK_BYTES):
        yield chunk


@router.get("/files/{file_id}/content")
async def file_content(
    file_id: str, caller: Caller, svc: Batches, deps: Annotated[Services, Depends(services)]
) -> TimedStream:
    content, size = await svc.content(caller, file_id)
    headers = {} if size is None else {"Content-Length": str(size)}
    # A download nobody reads is cut off: it held a chunk and a database page for ever.
    timeout_s = deps.settings.gateway_write_timeout_s
    return TimedStream(content, timeout_s, headers, "application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, caller: Caller, svc: Batches) -> dict[str, Any]:
    return await svc.delete_file(caller, file_id)


@router.post("/batches")
async def create_batch(
    body: CreateBatch, request: Request, caller: Caller, svc: Batches
) -> dict[str, Any]:
    # The lines carry the caller's own key: admission checks and charges it, as for
    # any Kafka client (current_principal has checked the header's form).
    api_key = request.headers["authorization"].partition(" ")[2].strip()
    return await svc.create(caller, api_key, body)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, caller: Caller, svc: Batches) -> dict[str, Any]:
    return await svc.retrieve(caller, batch_id)


@router.get("/batches")
async def list_batches(
    caller: Caller,
    svc: Batches,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    return await svc.list(caller, limit, after)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: Caller, svc: Batches) -> dict[str, Any]:
    return await svc.cancel(caller, batch_id)
