"""The rollup tables, per user and per model: faust Tables kept in memory with changelog
topics in Kafka (a restarted app recovers them), and the one way they change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import faust
import orjson

from schemas import topics
from streams.outputs import Send
from streams.rollups import WINDOWS_S, Rollup, table_key

DIMENSIONS = ("user", "model")
RollupKey = tuple[str, int, str, str]  # (window, start_ms, dimension, key)


class RollupTables:
    def __init__(self, app: faust.App, retention_windows: int, publish: Send) -> None:
        self._tables = {
            dimension: app.Table(
                f"rollups-by-{dimension}",
                default=None,
                partitions=topics.USAGE_PARTITIONS,  # co-partitioned with `usage`
                key_type=bytes,
                value_type=bytes,  # orjson of Rollup.dump(), the app's raw serializer
            )
            for dimension in DIMENSIONS
        }
        self._retention_windows = retention_windows
        self._publish = publish

    async def update(self, keys: list[RollupKey], apply: Callable[[Rollup], bool]) -> None:
        """Apply one record to each rollup it belongs to, publish what changed, and drop
        the window that fell out of retention."""
        for window, start, dimension, key in keys:
            table = self._tables[dimension]
            name = table_key(window, start, dimension, key).encode()
            stored = table.get(name)
            fresh = Rollup(window, start, dimension, key)
            rollup = Rollup.load(orjson.loads(stored)) if stored else fresh
            if not apply(rollup):
                continue  # replayed after a restart: already counted
            table[name] = orjson.dumps(rollup.dump())
            expired = start - self._retention_windows * WINDOWS_S[window] * 1000
            table.pop(table_key(window, expired, dimension, key).encode(), None)
            await self._publish(name, orjson.dumps(rollup.summary()))

    def summaries(self, dimension: str, key: str) -> list[dict[str, Any]] | None:
        """Every window of one user or model, newest first; None for an unknown dimension."""
        table = self._tables.get(dimension)
        if table is None:
            return None
        prefix = f"{dimension}/{key}/".encode()
        found = [
            Rollup.load(orjson.loads(v)).summary() for k, v in table.items() if k.startswith(prefix)
        ]
        return sorted(found, key=lambda s: (s["window"], -s["start_ms"]))
