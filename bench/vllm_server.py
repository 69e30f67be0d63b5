"""vLLM's own OpenAI server, started with the same engine settings as a worker (dtype and
executor included): the reference every Tandoor benchmark is compared with, in the same
run."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.loadgen import Probe, RunStats, openai_sender, run_level, warm_up
from infra.process import free_port
from tandoor.settings import Settings
from workers.dtype import resolve_dtype
from workers.engine import choose_eager
from workers.executor import resolve_executor


def engine_settings(args: argparse.Namespace) -> dict[str, object]:
    """What both sides run with: the worker gets them in its TANDOOR_MODELS (it got only
    the slots and the cache, so a dtype or executor set for the comparison reached the
    direct server alone), and the direct server as its arguments."""
    config = Settings().models["smollm2"]
    return {
        "dtype": config.dtype,
        "executor": config.executor,
        "max_num_seqs": args.max_seqs,
        "kv_cache_mib": args.kv_cache_mib,
    }


def start_vllm_server(
    model_dir: Path, port: int, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    config = Settings().models["smollm2"]
    # As a worker here runs it (on a CPU: in the engine-core process); this also sets the
    # environment vLLM needs for that, which the server inherits.
    executor = resolve_executor(config.executor, config.tensor_parallel_size)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        resolve_dtype(config.dtype).dtype,  # what a worker here computes in
        "--max-model-len",
        "2048",
        *(["--enforce-eager"] if choose_eager(config.enforce_eager) else []),  # as a worker
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(args.max_seqs),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_mib * 1024 * 1024),
        *(["--distributed-executor-backend", executor] if executor else []),
    ]
    log = open(args.log_dir / "vllm-server.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def refuse_taken(port: int) -> None:
    """A server left on the port (a killed run's) answered the health check in place of
    the one starting, which then exited on the taken port: its figures stood for the
    direct server's."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return
    writer.close()
    raise RuntimeError(f"port {port} is taken (a vLLM server left running?); stop it first")


async def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("vLLM server exited during start-up")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


async def bench_direct(
    model_dir: Path, args: argparse.Namespace, beside: dict[str, int] | None = None
) -> list[tuple[str, RunStats]]:
    """`beside`: other processes (name -> pid) whose CPU use to show with the server's."""
    port = args.vllm_port or free_port()
    await refuse_taken(port)
    proc = start_vllm_server(model_dir, port, args)
    probe = Probe({"vLLM server": proc.pid, **(beside or {})})
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", proc)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            send = openai_sender(client, f"http://127.0.0.1:{port}", "smollm2", args)
            await warm_up(send, max(args.concurrency))
            return [
                (
                    "vLLM OpenAI server",
                    await run_level(send, c, args.requests_per_stream, probe),
                )
                for c in args.concurrency
            ]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
