"""How every long-running role lives: start, run until SIGTERM/SIGINT, close."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Protocol


class Role(Protocol):
    async def start(self) -> None: ...

    async def run(self) -> None:
        """Work until request_stop(), then finish or hand back what is in flight."""

    def request_stop(self) -> None: ...

    async def close(self) -> None:
        """Release what start() opened; safe after a failed or partial start."""


_fatal: list[BaseException] = []


def fatal(error: BaseException) -> None:
    """A part the role cannot live without (a background task) died: stop the role as
    SIGTERM does, and exit non-zero once it has stopped."""
    _fatal.append(error)
    signal.raise_signal(signal.SIGTERM)


def fatal_error() -> BaseException | None:
    return _fatal[0] if _fatal else None


def exit_if_fatal() -> None:
    if _fatal:
        raise SystemExit(f"stopped after a fatal error: {_fatal[0]!r}")


async def serve(make_role: Callable[[], Role]) -> None:
    """Build the role inside the event loop (Kafka clients bind to it), then run it."""
    role = make_role()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, role.request_stop)
    try:
        await role.start()
        await role.run()
    finally:
        await role.close()
    exit_if_fatal()
