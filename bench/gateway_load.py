"""Load on one gateway process and the stack behind it, each figure beside a
reference measured in the same run:

  streams    concurrent SSE reply streams held by ONE gateway process (a model with
             worker that takes nothing: replies never start, streams stay open):
             RSS and open fds per level, memory per stream, /health latency;
             reference: the same process at 0 streams.
  sustained  --minutes of chat at a fixed rate of short replies from several users
             over the full path (gateway, worker with the bundled model, persist):
             RSS of each role and consumer lag sampled every --sample-s, growth
             from the first to the last third of the run.
  fairness   paid-tier (plus) probes at a steady rate, alone (the reference, before
             and after) and during a flood of free-tier users that saturates the
             worker: TTFT p95 increase against the 25 % target, each TTFT split into
             queue, engine and the rest.

Each phase is a module: bench/load_streams.py, load_sustained.py, load_fairness.py.

    python -m bench.gateway_load [--phase streams|sustained|fairness|all]
        [--levels 0 250 500 1000 2000] [--minutes 5] [--rate 2] [--probe-s 60] ...

Runs against the servers of the environment (Kafka, Cassandra, Redis must be up:
`tandoor infra up`); it starts its own roles on fresh model names (own topics and
groups) and stops them on exit.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from bench.load_fairness import phase_fairness
from bench.load_stack import full_stack
from bench.load_streams import phase_streams
from bench.load_sustained import phase_sustained
from bench.loadgen import stop_on_sigterm
from bench.machine import describe_machine

DEFAULT_LEVELS = [0, 250, 500, 1000, 2000]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--phase", choices=["streams", "sustained", "fairness", "all"], default="all")
    p.add_argument("--levels", type=int, nargs="+", default=DEFAULT_LEVELS, help="streams")
    p.add_argument("--stream-users", type=int, default=10)
    p.add_argument("--open-concurrency", type=int, default=32)
    p.add_argument("--health-probes", type=int, default=20)
    p.add_argument("--health-limit-ms", type=float, default=1000.0)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=2.0, help="replies per second")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="replies per conversation")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=20.0, help="load before sampling")
    p.add_argument("--probe-rate", type=float, default=1.0)
    p.add_argument("--probe-s", type=float, default=60.0)
    p.add_argument("--flood-users", type=int, default=48, help="more than --max-seqs")
    p.add_argument("--flood-tokens", type=int, default=64)
    p.add_argument("--flood-warmup-s", type=float, default=10.0)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


async def run(args: argparse.Namespace) -> None:
    if args.phase in ("streams", "all"):
        await phase_streams(args)
    if args.phase in ("sustained", "fairness", "all"):
        async with full_stack(args) as stack:
            if args.phase in ("sustained", "all"):
                await phase_sustained(stack, args)
            if args.phase in ("fairness", "all"):
                await phase_fairness(stack, args)


def main() -> None:
    args = parse_args()
    stop_on_sigterm()  # gpu_check.sh's limit: the roles are stopped on the way out
    print(describe_machine(), flush=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
