"""Each surface charges a request to its user in the tier of the key it came with
(stand-in quotas that record what they were asked): a user's batch key and chat key
count against their own tiers' limits, not one counter held to either's."""

from __future__ import annotations

from typing import Any, cast

from producers.gateway.chat.checks import ReplyChecks
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import DefaultModerator
from tandoor.policies.quota import Quotas, charged
from tandoor.settings import Settings


class Recording:
    def __init__(self) -> None:
        self.accounts: list[str] = []

    async def admit(self, account: str, policy: Any, request_id: str, *_: Any) -> Any:
        self.accounts.append(account)
        return charged(account, request_id, 1, 0)


async def test_the_gateway_charges_the_user_in_the_tier_of_its_key() -> None:
    quotas = Recording()
    checks = ReplyChecks(Settings(), DefaultModerator(), cast(Quotas, quotas))
    for tier in ("plus", "api"):
        await checks.admit(Principal("ada", tier, f"k-{tier}"), f"r-{tier}", 10, 1_000)
    assert quotas.accounts == ["ada:plus", "ada:api"]
