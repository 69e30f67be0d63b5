"""What the benchmarks sample from outside the roles: memory and file descriptors
from /proc, and consumer-group lag from Kafka."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from infra.roles import RoleProcess
from infra.topics import token_partitions
from producers.model_load import backlog_clients, count_backlog
from tandoor.settings import Settings


def rss_mib(pid: int) -> float:
    """VmRSS of one process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def tree_total(pid: int, measure: Callable[[int], float]) -> float:
    """`measure` summed over a process and its live descendants (a worker's vLLM engine
    core is one; so is vLLM's API server's)."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            total += measure(p)
        except FileNotFoundError:  # exited meanwhile
            continue
    return total


def tree_rss_mib(pid: int) -> float:
    return tree_total(pid, rss_mib)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds one process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def tree_cpu_s(pid: int) -> float:
    return tree_total(pid, cpu_s)


def cpu_snapshot(processes: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree."""
    return {name: tree_cpu_s(pid) for name, pid in processes.items()}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pid_of(role: RoleProcess) -> int:
    assert role.proc is not None, f"{role.name} was not started"
    return role.proc.pid


@dataclass
class LagProbe:
    """Lag of the model's worker group on its prompt topic (prompts waiting or in
    flight) and of the persist group on `tokens` (events not yet stored)."""

    settings: Settings
    admin: AIOKafkaAdminClient
    offsets: AIOKafkaConsumer

    async def worker_lag(self, model: str) -> int:
        partitions = sum(band.partitions for band in self.settings.bands)
        return await count_backlog(self.admin, self.offsets, partitions, model)

    async def persist_lag(self) -> int:
        tps = token_partitions(self.settings)
        ends = await self.offsets.end_offsets(tps)
        committed = await self.admin.list_consumer_group_offsets(self.settings.persist_group)
        return sum(
            max(0, ends[tp] - committed[tp].offset) if tp in committed else ends[tp] for tp in tps
        )


@asynccontextmanager
async def lag_probe(settings: Settings) -> AsyncIterator[LagProbe]:
    async with backlog_clients(settings) as (admin, offsets):
        yield LagProbe(settings, admin, offsets)
