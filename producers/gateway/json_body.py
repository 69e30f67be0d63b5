"""Request bodies parsed by orjson, which refuses text that is not valid Unicode.

`json.loads` (what FastAPI uses) decodes the escape "\\ud800" to a lone surrogate, which
then fails far from the request: in the Cassandra driver (answered as "Cassandra is
unreachable", leaking one of the connection's stream ids each time), in Kafka's
serializer or in a nested model (a bare 500). orjson refuses it as invalid JSON, a 400
before any handler runs, as it does on the batch topic. It also refuses NaN and
Infinity; an integer beyond 64 bits becomes a float, which every numeric field's range
refuses."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

# An upload's form (POST /v1/files): its file goes to disk as it is read, but every other
# field is held in memory. Starlette's defaults (1,000 fields of up to 1 MiB) let one
# user's stalled uploads pin 64 MiB each; the OpenAI client sends `purpose` and a few more.
FORM_MAX_FIELDS = 16
FORM_MAX_FIELD_BYTES = 64 * 1024


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())  # JSONDecodeError, as FastAPI expects
        return self._json

    def form(
        self,
        *,
        max_files: int | float = 1,
        max_fields: int | float = FORM_MAX_FIELDS,
        max_part_size: int = FORM_MAX_FIELD_BYTES,
    ) -> Any:
        """Past a limit, a 400 that names it (Starlette's own)."""
        return super().form(max_files=max_files, max_fields=max_fields, max_part_size=max_part_size)


class StrictJsonRoute(APIRoute):
    """Every gateway route's: its handler is given a StrictJsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict
