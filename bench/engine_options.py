"""Engine options side by side on this machine, each variant in a fresh process, in
turn: where the model runs on a CPU (`--compare executor`: in the engine-core process,
`uni`, what `executor: auto` takes there, against vLLM's default worker process, `mp`),
or the dtype it computes in (`--compare dtype`: float32, bfloat16 and float16; the
first line says which one `dtype: auto` takes here).

    python -m bench.engine_options [--compare executor|dtype] [--streams 16]
        [--max-tokens 128] [--rounds 2]

Prints start-up time (import to ready) and decode speed at 1 and at `--streams` streams.
Needs no servers: the engine only."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from bench.machine import describe_machine
from schemas.events import ChatMessage, Sampling
from tandoor.settings import Settings
from workers.engine import Engine, EngineOptions
from workers.model_store import resolve_model_dir

VARIANTS: dict[str, tuple[str, ...]] = {
    "executor": ("uni", "mp"),
    "dtype": ("float32", "bfloat16", "float16"),
}


async def measure_one(option: str, value: str, streams: int, max_tokens: int) -> dict[str, Any]:
    model_dir = resolve_model_dir("smollm2", Settings())
    started = time.monotonic()
    options = EngineOptions(model_dir, max_num_seqs=32, kv_cache_memory_bytes=1 << 30)
    engine = await Engine.start(EngineOptions(**{**options.__dict__, option: value}))
    start_s = time.monotonic() - started
    prompt = engine.render_prompt([ChatMessage(role="user", content="Tell me about the sea.")])
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def reply(i: int) -> int:
        return sum([o.new_tokens async for o in engine.generate(f"{value}-{i}", prompt, sampling)])

    async def tokens_per_s(count: int) -> float:
        began = time.monotonic()
        made = await asyncio.gather(*(reply(i) for i in range(count)))
        return sum(made) / (time.monotonic() - began)

    await reply(-1)  # the first request pays one-off costs
    figures = {
        "start_s": start_s,
        "one": await tokens_per_s(1),
        "many": await tokens_per_s(streams),
    }
    await engine.shutdown()
    return figures


def run_in_child(option: str, value: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.engine_options", "--child", option, value]
    command += ["--streams", str(args.streams), "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{option} {value} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=VARIANTS, default="executor")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        option, value = args.child
        figures = asyncio.run(measure_one(option, value, args.streams, args.max_tokens))
        print(json.dumps(figures))
        return
    print(describe_machine())
    print(f"{args.compare:<10}{'start s':>9}{'tok/s at 1':>12}{f'tok/s at {args.streams}':>14}")
    for _ in range(args.rounds):  # interleaved: a drifting machine shows in both
        for value in VARIANTS[args.compare]:
            got = run_in_child(args.compare, value, args)
            print(f"{value:<10}{got['start_s']:>9.1f}{got['one']:>12.1f}{got['many']:>14.1f}")


if __name__ == "__main__":
    main()
