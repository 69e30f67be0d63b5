"""Which priority band gets the next free engine slot.

Strict priority, with a reserved share so no band starves: each time a waiting
band is passed over it earns `reserve` of a slot, and a full credit buys it the
next one. With reserve 0.1 a flooded lower band still gets about one slot in ten.

And a share of the worker's slots (`kept_for_top`) is only ever given to the top
band: a flood of lower-band prompts fills the rest, so a top-band prompt finds a slot
at once instead of waiting for a lower-band reply to end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class BandScheduler:
    def __init__(
        self, bands: Sequence[str], reserve: float = 0.1, max_slots: int = 0, kept_for_top: int = 0
    ) -> None:
        if not 0.0 <= reserve <= 1.0:
            raise ValueError(f"reserve must be within [0, 1], got {reserve}")
        if not 0 <= kept_for_top <= max_slots:
            raise ValueError(f"kept_for_top must be within [0, {max_slots}], got {kept_for_top}")
        self.bands = list(bands)  # highest priority first
        self.reserve = reserve
        self.lower_limit = max_slots - kept_for_top  # slots all lower bands may hold
        self._limited = kept_for_top > 0
        self._credit = dict.fromkeys(self.bands, 0.0)

    def lower_headroom(self, held: Mapping[str, int]) -> int | None:
        """More slots the lower bands may take now; None without a limit."""
        if not self._limited:
            return None
        return max(0, self.lower_limit - sum(held.get(b, 0) for b in self.bands[1:]))

    def plan(
        self, free_slots: int, backlog: Mapping[str, int], held: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Share `free_slots` among bands with waiting prompts; `held` is what each band
        holds already (the lower bands' limit counts it)."""
        remaining = {band: backlog.get(band, 0) for band in self.bands}
        headroom = self.lower_headroom(held or {})
        slots: dict[str, int] = {}
        for _ in range(free_slots):
            if headroom == 0:
                remaining.update(dict.fromkeys(self.bands[1:], 0))
            band = self._next(remaining)
            if band is None:
                break
            slots[band] = slots.get(band, 0) + 1
            remaining[band] -= 1
            if headroom is not None and band != self.bands[0]:
                headroom -= 1
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
