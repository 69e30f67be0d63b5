"""The fairness phase's free-tier flood, as a process of its own at the lowest CPU
priority: on a real deployment the flooding clients run on other machines, so here
their parsing of dozens of streams must not take cores from the system under test,
nor delay the paid probes' own event loop (which would count as TTFT).

    python -m bench.flood_client --port P --model M --users 48 --tokens 64 --turns 4

Prints "ready" once its users exist, floods until SIGTERM, lets the replies in flight
end, then prints its outcomes as one JSON line on stdout: {"errors": n, "replies":
[[ended_at, ttft_s, total_s, tokens, queue_s, worker_ttft_s], ...]} (ended_at on the
shared monotonic clock).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from dataclasses import astuple

import orjson

from bench.chat_load import Outcomes, Turns, closed_loop, make_users
from bench.load_stack import REPLY_TIMEOUT, gateway_client
from tandoor.settings import Settings


async def flood(args: argparse.Namespace) -> Outcomes:
    out, stop = Outcomes(), asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with gateway_client(args.port, REPLY_TIMEOUT) as client:
        users = await make_users(Settings(), client, "free", args.users, args.model)
        print("ready", flush=True)  # the parent waits for this line
        loops = [
            closed_loop(Turns(user, args.model, args.turns), args.tokens, stop, out)
            for user in users
        ]
        await asyncio.gather(*loops)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--users", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    os.nice(19)
    out = asyncio.run(flood(args))
    replies = [[ended, *astuple(times)] for ended, times in out.replies]
    sys.stdout.buffer.write(orjson.dumps({"errors": out.errors, "replies": replies}) + b"\n")


if __name__ == "__main__":
    main()
