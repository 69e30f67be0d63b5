"""Which model answers a prompt, or that none can start it in time (docs/architecture.md,
"When a model is busy").

1. Shedding: while a model's backlog in a tier's band and the bands above it is at or
   past a fallback rule's threshold, the rule's tiers are answered by its fallback model.
2. Busy: a prompt the model's workers cannot start within the tier's wait budget is
   refused at once (503 with Retry-After) instead of waiting until it expires, or goes
   to the tier's fallback where that one is not busy too. It cannot start in time when
   - no worker is in the model's group; or
   - the prompts ahead of it (its band's and the bands above, beyond the ones being
     generated: up to the model's `max_num_seqs` per worker, of which the bands below the
     top one hold at most all but the top band's kept share) take longer than the budget
     at the rate the workers finished prompts lately; or
   - prompts are ahead and none finished for a whole budget.
A load not measured (just started, Kafka not answering) never refuses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from producers.gateway.errors import ApiError
from producers.model_load import ModelLoad
from tandoor.settings import Fallback, Settings

log = logging.getLogger(__name__)

NO_WORKER_RETRY_S = 10
STALLED_RETRY_S = 10
MAX_RETRY_S = 60

BUSY = Counter(
    "tandoor_gateway_busy_refusals",
    "Prompts refused at once because the model's workers could not start them in time",
    ["model", "reason"],
    registry=None,  # registered with the gateway's registry (producers/gateway/metrics.py)
)

SHED = Counter(
    "tandoor_gateway_shed_requests",
    "Prompts answered by the model's fallback instead (TANDOOR_FALLBACKS)",
    ["model", "fallback", "reason"],  # reason: backlog (past the rule's) or busy
    registry=None,
)


@dataclass(frozen=True)
class Busy:
    reason: str  # no_worker, backlog or stalled: the metric's label
    detail: str
    retry_after_s: int


def busy(
    load: ModelLoad | None,
    bands_ahead: list[str],
    slots: int,
    budget_s: float,
    kept_for_top: int = 0,
) -> Busy | None:
    """Why a prompt of the last of `bands_ahead` cannot start within `budget_s`, if so."""
    if load is None:
        return None
    if load.workers == 0:
        return Busy("no_worker", "no worker serves it right now", NO_WORKER_RETRY_S)
    ahead = load.waiting(bands_ahead, slots, kept_for_top)
    if ahead <= 0:
        return None
    rate = load.finished_per_s
    if rate:
        wait_s = ahead / rate
        if wait_s <= budget_s:
            return None
        retry_s = min(MAX_RETRY_S, max(1, math.ceil(wait_s - budget_s)))
        detail = f"{ahead} prompts are ahead (about {wait_s:.0f} s; the limit is {budget_s:.0f} s)"
        return Busy("backlog", detail, retry_s)
    if load.idle_s < budget_s:
        return None  # not watched long enough to tell
    detail = f"{ahead} prompts are ahead and none finished in {load.idle_s:.0f} s"
    return Busy("stalled", detail, STALLED_RETRY_S)


class ModelRouter:
    """The model that answers: the asked one, its fallback, or none (a 503)."""

    def __init__(self, settings: Settings, load: Callable[[str], ModelLoad | None]) -> None:
        self.settings = settings
        self.load = load
        bands = [band.name for band in settings.bands]  # highest priority first
        self._ahead = {
            tier: bands[: bands.index(policy.band) + 1] for tier, policy in settings.tiers.items()
        }

    def answering(
        self, model: str, tier: str, takes: Callable[[str], bool] = lambda _: True
    ) -> str:
        """`takes`: whether a model can take the request (its context window): a
        fallback that cannot is not shed to. Asked only when shedding."""
        self.served(model)
        rule = self._fallback(model, tier)
        load = self.load(model)
        ahead = None if load is None else load.of(self._ahead[tier])  # lower bands wait behind
        if (
            rule is not None
            and ahead is not None
            and ahead >= rule.backlog
            and self.busy(rule.model, tier) is None  # it can start it in time
            and takes(rule.model)
        ):
            SHED.labels(model, rule.model, "backlog").inc()
            log.info(
                "shedding %s: backlog %d >= %d, %s answers", model, ahead, rule.backlog, rule.model
            )
            return rule.model
        verdict = self.busy(model, tier)
        if verdict is None:
            return model
        if rule is not None and self.busy(rule.model, tier) is None and takes(rule.model):
            SHED.labels(model, rule.model, "busy").inc()
            log.info("shedding %s: busy (%s), %s answers", model, verdict.detail, rule.model)
            return rule.model
        BUSY.labels(model, verdict.reason).inc()
        raise ApiError(
            503,
            f"model {model!r} is busy: {verdict.detail}; please retry in {verdict.retry_after_s} s",
            kind="service_unavailable",
            headers={"Retry-After": str(verdict.retry_after_s)},
        )

    def served(self, model: str) -> None:
        """A 404 for a model no longer configured (a conversation outlives its config)."""
        if model not in self.settings.models:
            raise ApiError(
                404,
                f"model {model!r} is no longer served; start a new conversation with one of "
                f"{sorted(self.settings.models)}",
                param="model",
                kind="not_found_error",
            )

    def busy(self, model: str, tier: str) -> Busy | None:
        slots, kept = self.settings.models[model].max_num_seqs, self.settings.kept_for_top(model)
        budget_s = self.settings.wait_budget_s(tier)
        return busy(self.load(model), self._ahead[tier], slots, budget_s, kept)

    def _fallback(self, model: str, tier: str) -> Fallback | None:
        rule = self.settings.fallbacks.get(model)
        return rule if rule is not None and tier in rule.tiers else None
