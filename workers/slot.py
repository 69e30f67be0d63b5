"""The engine slot a prompt's task holds from the moment its record is taken."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from workers.capacity import Capacity
from workers.intake import PromptIntake, Record


class Waiter(Protocol):
    """What a prompt waiting on another worker (or on its own copy) does with its slot."""

    async def give_back(self) -> None: ...

    async def take_again(
        self, give_up: Callable[[], bool] = ..., wake_in_s: float | None = None
    ) -> bool:
        """Held again (True), or not, as `give_up` became true first (False)."""


@dataclass
class Slot:
    """Given back while the prompt waits for a reply that runs elsewhere (a rebalance
    hands every running prompt's partition on, and the new owner fetches them all): held,
    such waits filled a fresh worker's slots until the longest reply ended, and the
    prompts queued behind them expired. Counted in its band meanwhile neither."""

    capacity: Capacity
    intake: PromptIntake
    record: Record
    held: bool = True

    async def give_back(self) -> None:
        if self.held:
            self.held = False
            self.intake.copy_of_running(self.record)
            await self.capacity.release_seq()

    async def take_again(
        self, give_up: Callable[[], bool] = lambda: False, wake_in_s: float | None = None
    ) -> bool:
        if self.held:
            return True
        if not await self.capacity.take_seq_back(give_up, wake_in_s):
            return False
        self.intake.running_again(self.record)
        self.held = True
        return True


class NoSlot:
    """For a prompt run outside the intake (tests): nothing to give back."""

    async def give_back(self) -> None:
        return None

    async def take_again(
        self, give_up: Callable[[], bool] = lambda: False, wake_in_s: float | None = None
    ) -> bool:
        return True
