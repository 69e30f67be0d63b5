"""Which priority band gets the next free engine slot.

Strict priority, with a reserved share so no band starves: each time a waiting
band is passed over it earns `reserve` of a slot, and a full credit buys it the
next one. With reserve 0.1 a flooded lower band still gets about one slot in ten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class BandScheduler:
    def __init__(self, bands: Sequence[str], reserve: float = 0.1) -> None:
        if not 0.0 <= reserve <= 1.0:
            raise ValueError(f"reserve must be within [0, 1], got {reserve}")
        self.bands = list(bands)  # highest priority first
        self.reserve = reserve
        self._credit = dict.fromkeys(self.bands, 0.0)

    def plan(self, free_slots: int, backlog: Mapping[str, int]) -> dict[str, int]:
        """Share `free_slots` among bands with waiting prompts."""
        remaining = {band: backlog.get(band, 0) for band in self.bands}
        slots: dict[str, int] = {}
        for _ in range(free_slots):
            band = self._next(remaining)
            if band is None:
                break
            slots[band] = slots.get(band, 0) + 1
            remaining[band] -= 1
        return slots

    def _next(self, remaining: Mapping[str, int]) -> str | None:
        waiting = [band for band in self.bands if remaining[band] > 0]
        if not waiting:
            return None
        top, lower = waiting[0], waiting[1:]
        for band in reversed(lower):  # the most starved (lowest) band cashes in first
            if self._credit[band] >= 1.0:
                self._credit[band] -= 1.0
                return band
        for band in lower:
            self._credit[band] = min(1.0, self._credit[band] + self.reserve)
        return top
