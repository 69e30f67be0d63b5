"""The token-path benchmark counts replies, not streams: one that ends in an error chunk
or without its usage is an error (it counted as a reply of no tokens)."""

from __future__ import annotations

import httpx
import pytest

from bench.token_path import ReplyFailed, stream_once


def answering(*chunks: str) -> httpx.AsyncClient:
    body = "".join(f"data: {chunk}\n\n" for chunk in [*chunks, "[DONE]"])
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    return httpx.AsyncClient(transport=transport)


async def test_a_reply_counts_its_usage_tokens() -> None:
    async with answering('{"choices":[]}', '{"usage":{"completion_tokens":7}}') as client:
        assert await stream_once(client, "http://gateway/v1", "m", "k") == 7


@pytest.mark.parametrize(
    "chunks",
    [
        ['{"choices":[]}', '{"error":{"message":"the reply was restarted"}}'],
        ['{"choices":[]}'],
    ],
)
async def test_an_error_chunk_or_no_usage_is_not_a_reply(chunks: list[str]) -> None:
    async with answering(*chunks) as client:
        with pytest.raises(ReplyFailed):
            await stream_once(client, "http://gateway/v1", "m", "k")
