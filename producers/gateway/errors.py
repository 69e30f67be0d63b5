"""Errors as clients see them: a status code and an OpenAI-shaped JSON body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.errors import error_body, shortened
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN

log = logging.getLogger(__name__)  # held to a line per 5 s (tandoor/logs.py, NOISY)

# A store that cannot be reached (restarting, overloaded): a 503 the client may retry,
# never a bare 500. Where a request can be served without it, the route handles it first.
UNREACHABLE = (*CASSANDRA_DOWN, *REDIS_DOWN)
UNREACHABLE_RETRY_S = 5
QUEUE_RETRY_S = 2  # Kafka did not take a prompt or a stop: a broker restart takes seconds
# On a 409 that the same request meets again: the OpenAI SDKs retry every 409 (a lock
# timeout, to them) twice unless told not to, a whole upload each time.
NOT_RETRIED = {"x-should-retry": "false"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = dict(headers or {})  # its own: a shared one may be passed
        self.code = code


def unavailable(
    what: str, retry_after_s: int = UNREACHABLE_RETRY_S, changed: bool = False
) -> ApiError:
    done = "" if changed else "nothing was changed, "
    return ApiError(
        503,
        f"{what}; {done}please retry in {retry_after_s} s",
        kind="service_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def kafka_unreachable(message: str) -> ApiError:
    return ApiError(
        503, message, kind="service_unavailable", headers={"Retry-After": str(QUEUE_RETRY_S)}
    )


def unknown_model(model: str, param: str = "model") -> ApiError:
    """OpenAI's answer for a model it does not serve, on every surface (chat, OpenAI
    API, batch line)."""
    return ApiError(
        404, f"model {model!r} does not exist; see /v1/models", param=param, code="model_not_found"
    )


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found", kind="not_found_error")


def count(text: str, limit: int = 2**31) -> int | None:
    """A non-negative integer a client sent, or None: ASCII digits only (str.isdigit
    takes '²', which int() refuses) and below `limit` (a huge number is no position)."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(limit)):
        return None
    value = int(text)
    return value if value < limit else None


def error_response(exc: ApiError) -> JSONResponse:
    body = error_body(exc.message, exc.kind, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def store_unreachable(exc: Exception) -> ApiError:
    """The 503 for one of UNREACHABLE, naming the store."""
    return unavailable(f"{'Redis' if isinstance(exc, REDIS_DOWN) else 'Cassandra'} is unreachable")


def tagged_refusal(exc: BaseException, request_id: str) -> BaseException:
    """A request refused once admitted, as answered: tagged with the id its logs name (the
    SDK's `_request_id`). A store out of reach is made its 503 here, to be tagged too."""
    if isinstance(exc, UNREACHABLE):
        log.warning("%s: %s (%r)", request_id, (refused := store_unreachable(exc)).message, exc)
        exc = refused
    if isinstance(exc, ApiError):
        exc.headers.setdefault("X-Request-Id", request_id)
    return exc


def install_error_handlers(app: FastAPI) -> None:
    """Every error in one place, each as JSON that names the problem."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def _unreachable(request: Request, exc: Exception) -> JSONResponse:
        """Said in the log too, with the driver's exception: the 503 alone left a bad
        partition (a read failure on tombstones) looking like an outage."""
        refused = store_unreachable(exc)
        log.warning("%s %s: %s (%r)", request.method, request.url.path, refused.message, exc)
        return error_response(refused)

    for unreachable in UNREACHABLE:
        app.add_exception_handler(unreachable, _unreachable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        sent_as = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and not _json_media(sent_as):
            # FastAPI reads a body sent as anything but JSON (curl -d: a form) as bytes:
            # the message named an internal class, never the Content-Type.
            message = (
                "the body must be JSON, sent with Content-Type: application/json "
                f"(it came as {shortened(sent_as, 80) or 'no Content-Type'!r})"
            )
            return JSONResponse(error_body(message, "invalid_request_error"), 400)
        if first.get("type") == "json_invalid":  # loc is (body, position): no field to name
            reason = first.get("ctx", {}).get("error", "")
            message = f"the body is not valid JSON: {reason} (at character {first['loc'][-1]})"
            return JSONResponse(error_body(message, "invalid_request_error"), 400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
        message = f"{where or 'request'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, "invalid_request_error", where or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # Its headers kept: a 405's Allow names the methods the route takes.
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A defect: still the JSON body every client parses (the traceback is logged by
        the server); a bare text 500 broke OpenAI clients' error handling."""
        message = f"internal error ({type(exc).__name__}); it is logged, please report it"
        return JSONResponse(error_body(message, "api_error"), 500)


def _json_media(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json or a
    +json type; not text/json, nor application/jsonl)."""
    main, _, sub = content_type.partition(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))
