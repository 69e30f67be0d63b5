"""The token path benchmark's reference: a bare Starlette server that streams OpenAI-style
chunks from memory, shaped like the gateway's (the same delta per chunk, a usage chunk,
[DONE]), with nothing behind it. What one Python process can push to SSE clients here.

    python -m bench.sse_reference PORT [--events 256] [--tokens-per-event 16]
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

WORD = "tok "


def app(events: int, per_event: int) -> Starlette:
    async def completions(request: Request) -> StreamingResponse:
        body = orjson.loads(await request.body())
        base = {"id": "chatcmpl-ref", "object": "chat.completion.chunk", "model": body["model"]}
        delta = WORD * per_event

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(events):
                choice = {"index": 0, "delta": {"content": delta}, "finish_reason": None}
                yield b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": events * per_event}
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--tokens-per-event", type=int, default=16)
    args = parser.parse_args()
    served = app(args.events, args.tokens_per_event)
    uvicorn.run(served, host="127.0.0.1", port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main()
