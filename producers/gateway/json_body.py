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


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())  # JSONDecodeError, as FastAPI expects
        return self._json


class StrictJsonRoute(APIRoute):
    """Every gateway route's: its handler is given a StrictJsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict
