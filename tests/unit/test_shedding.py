"""Which model answers: the asked one, its fallback while its backlog is too long, or
none at once (a 503 with Retry-After) when its workers cannot start the prompt in time."""

from __future__ import annotations

import pytest

from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.routing import Request, routed
from producers.gateway.errors import ApiError
from producers.gateway.shedding import ModelRouter, busy
from producers.model_load import (
    MIN_RATE_SPAN_S,
    RATE_WINDOW_S,
    LoadMonitor,
    Measured,
    ModelLoad,
    Progress,
)
from schemas.events import ChatMessage
from tandoor.models import ModelConfig
from tandoor.policies.moderation import DefaultModerator
from tandoor.settings import DEFAULT_TIERS, Fallback, Settings

SLOTS = 4  # each model's max_num_seqs
BUDGET_S = 60.0  # every tier's wait budget here


def load(
    waiting: int = 0,
    workers: int = 1,
    rate: float | None = None,
    idle_s: float = 0.0,
    band: str = "interactive-paid",
) -> ModelLoad:
    """`waiting` prompts beyond what the workers are generating, all in `band`."""
    backlog = {"interactive-paid": 0, "interactive-free": 0, "batch": 0}
    backlog[band] = waiting + workers * SLOTS if waiting or workers else 0
    return ModelLoad(backlog, workers, rate, idle_s)


def router(loads: dict[str, ModelLoad]) -> ModelRouter:
    tiers = {
        name: t.model_copy(update={"max_wait_s": BUDGET_S}) for name, t in DEFAULT_TIERS.items()
    }
    tiers["tiny"] = tiers["plus"].model_copy(update={"tokens_per_minute": 100})
    settings = Settings(
        models={
            name: ModelConfig(source=f"/models/{name}", max_num_seqs=SLOTS)
            for name in ("big", "small")
        },
        fallbacks={"big": Fallback(model="small", backlog=100, tiers=["free"])},
        tiers=tiers,
    )
    return ModelRouter(settings, loads.get)


def refused(route: ModelRouter, model: str, tier: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        route.answering(model, tier)
    assert caught.value.status == 503 and int(caught.value.headers["Retry-After"]) >= 1
    assert model in caught.value.message
    return caught.value


def test_a_listed_tier_is_shed_once_the_backlog_reaches_the_threshold() -> None:
    assert router({"big": load(waiting=95, rate=10)}).answering("big", "free") == "big"
    assert router({"big": load(waiting=96, rate=10)}).answering("big", "free") == "small"


def test_only_the_backlog_ahead_of_a_tier_sheds_it() -> None:
    """A batch job's thousands of lines wait behind the free band: they shed every free
    user to the smaller model while the asked one would have started them at once."""
    batch = load(waiting=10_000, rate=10, band="batch")
    assert router({"big": batch, "small": load()}).answering("big", "free") == "big"
    paid = load(waiting=96, rate=10, band="interactive-paid")  # ahead of the free band
    assert router({"big": paid, "small": load()}).answering("big", "free") == "small"


def test_a_backlog_is_not_shed_to_a_fallback_that_cannot_start_it_either() -> None:
    """A fallback kept at no workers (no traffic, so autoscaled to zero) or itself full
    took the prompt, and the user waited for its deadline where the asked model would
    have answered, or a 503 would have said so at once."""
    long = load(waiting=200, rate=10)  # 20 s to start: within the budget
    for fallback in (load(workers=0), load(waiting=10_000, rate=1)):
        assert router({"big": long, "small": fallback}).answering("big", "free") == "big"
        refused(router({"big": load(waiting=200, rate=1), "small": fallback}), "big", "free")
    assert router({"big": long, "small": load()}).answering("big", "free") == "small"


def test_other_tiers_and_models_are_not_shed_while_they_can_start_in_time() -> None:
    fast = load(waiting=500, rate=100)
    assert router({"big": fast}).answering("big", "plus") == "big"
    assert router({"small": fast}).answering("small", "free") == "small"


def test_an_unknown_load_neither_sheds_nor_refuses() -> None:
    assert router({}).answering("big", "free") == "big"
    assert router({}).answering("big", "plus") == "big"


def test_a_model_no_longer_configured_is_a_404_naming_it() -> None:
    """A conversation outlives a change of TANDOOR_MODELS: its next turn was a bare 500."""
    with pytest.raises(ApiError) as caught:
        router({}).answering("retired", "plus")
    assert caught.value.status == 404 and caught.value.param == "model"
    assert "'retired' is no longer served" in caught.value.message


def test_no_worker_is_refused_at_once_unless_a_fallback_can_answer() -> None:
    empty = load(workers=0)
    error = refused(router({"big": empty}), "big", "plus")
    assert "no worker" in error.message and error.headers["Retry-After"] == "10"
    assert router({"big": empty, "small": load()}).answering("big", "free") == "small"
    refused(router({"big": empty, "small": empty}), "big", "free")


def test_a_backlog_the_workers_cannot_start_within_the_budget_is_refused() -> None:
    assert router({"big": load(waiting=60, rate=1.0)}).answering("big", "plus") == "big"
    error = refused(router({"big": load(waiting=90, rate=1.0)}), "big", "plus")
    assert "90 prompts are ahead" in error.message
    assert error.headers["Retry-After"] == "30", "until the wait is back within the budget"


def test_prompts_ahead_and_nothing_finished_for_a_budget_is_refused() -> None:
    assert router({"big": load(waiting=1, rate=0.0, idle_s=59)}).answering("big", "plus") == "big"
    error = refused(router({"big": load(waiting=1, rate=0.0, idle_s=60)}), "big", "plus")
    assert "none finished" in error.message


def test_prompts_being_generated_are_not_ahead_of_anyone() -> None:
    generating = load(waiting=0, workers=2, rate=0.0, idle_s=3600)
    assert router({"big": generating}).answering("big", "plus") == "big"


def test_only_the_bands_above_and_its_own_are_ahead_of_a_prompt() -> None:
    flood = load(waiting=1000, rate=1.0, band="batch")
    assert router({"big": flood}).answering("big", "plus") == "big", "batch is below"
    assert busy(flood, ["interactive-paid", "interactive-free", "batch"], SLOTS, BUDGET_S)


def test_the_rate_is_the_commits_of_the_last_minute_once_watched_long_enough() -> None:
    progress = Progress()
    progress.add(0.0, 100, full=True)
    progress.add(MIN_RATE_SPAN_S / 2, 105, full=True)
    assert progress.rate() is None, "too short a look"
    progress.add(MIN_RATE_SPAN_S, 110, full=True)
    assert progress.rate() == pytest.approx(1.0)
    for t in range(11, 200):
        progress.add(float(t), 110, full=True)
    assert progress.rate() == 0.0, f"older than {RATE_WINDOW_S} s is forgotten"
    assert progress.idle_s(200.0) == pytest.approx(200.0 - MIN_RATE_SPAN_S)


class Watched:
    """A load monitor fed measurements of "big" (one worker, SLOTS slots), a second apart."""

    def __init__(self) -> None:
        self.monitor = LoadMonitor(router({}).settings)
        self.now, self.done = 0.0, 0

    def seconds(
        self, count: int, in_flight: int, finished_per_s: float = 0.0, band: str = ""
    ) -> ModelLoad:
        """`in_flight` prompts past the commits (running or waiting; in `band`, else the
        top one) for `count` seconds, `finished_per_s` of them committed each second."""
        partition = self.monitor.layout.band(band).first if band else 0
        for _ in range(count):
            self.now += 1.0
            self.done += round(finished_per_s) if finished_per_s >= 1 else 0
            measured = Measured(backlog={partition: in_flight}, done=self.done, workers=1)
            load = self.monitor.record("big", measured, self.now)
        return load


def test_a_burst_after_a_quiet_spell_is_taken() -> None:
    """Nothing to finish is no stall: after two idle minutes, prompts beyond the workers'
    slots start within seconds, and are not refused as "none finished in 120 s"."""
    watched = Watched()
    watched.seconds(120, in_flight=0)
    burst = watched.seconds(1, in_flight=SLOTS + 6)
    assert router({"big": burst}).answering("big", "plus") == "big"


def test_a_quiet_minute_is_no_measure_of_how_fast_the_workers_finish() -> None:
    """One reply in the last minute: a rate of 1/60 s said a burst of six more than the
    slots would wait six minutes, and refused it; the workers were idle, not slow."""
    watched = Watched()
    watched.seconds(5, in_flight=1)
    watched.done += 1  # it finished
    watched.seconds(55, in_flight=0)
    burst = watched.seconds(1, in_flight=SLOTS + 6)
    assert router({"big": burst}).answering("big", "plus") == "big"


def test_full_workers_are_measured_and_refuse_what_they_cannot_start_in_time() -> None:
    watched = Watched()
    full = watched.seconds(30, in_flight=SLOTS + 100, finished_per_s=1.0)
    assert full.finished_per_s == pytest.approx(1.0)
    assert "prompts are ahead" in refused(router({"big": full}), "big", "plus").message


def test_the_bands_below_the_top_count_only_the_slots_they_may_hold() -> None:
    """Each worker keeps a share of its slots for the top band (1 of 4 here): free
    prompts filling the rest wait, though fewer than every slot is taken. Counted
    against every slot they were ahead of no one, and the workers never counted as full
    (no rate measured), so nothing was refused and they expired unanswered."""
    free = "interactive-free"
    slow = load(waiting=0, workers=1, rate=0.01, band=free)  # 4 in flight: 3 run, 1 waits
    assert "1 prompts are ahead" in refused(router({"small": slow}), "small", "free").message
    assert router({"small": slow}).answering("small", "plus") == "small"  # a kept slot is free
    watched = Watched()
    measured = watched.seconds(30, in_flight=SLOTS, finished_per_s=1.0, band=free)
    assert measured.finished_per_s == pytest.approx(1.0), "the workers were full"


def test_full_workers_finishing_nothing_for_a_budget_are_stalled() -> None:
    watched = Watched()
    watched.seconds(120, in_flight=0)
    watched.seconds(int(BUDGET_S) - 1, in_flight=SLOTS + 1)
    stalled = watched.seconds(2, in_flight=SLOTS + 1)
    assert "none finished" in refused(router({"big": stalled}), "big", "plus").message


def test_a_fallback_to_an_unserved_model_is_refused() -> None:
    with pytest.raises(ValueError, match="tiny"):
        Settings(
            models={"big": ModelConfig(source="/models/big")},
            fallbacks={"big": Fallback(model="tiny", backlog=1, tiers=[])},
        )


def test_a_request_the_fallback_cannot_take_is_not_shed_to_it() -> None:
    """A prompt that fits only the asked model's window: shed, it was a 400 naming the
    other model's window, because of load. Asked only when shedding: each asking
    counts the context's tokens again."""
    asked: list[str] = []

    def takes_not_small(model: str) -> bool:
        asked.append(model)
        return model != "small"

    assert router({"big": load(waiting=10, rate=10)}).answering("big", "free", takes_not_small)
    assert asked == [], "asked without shedding"
    backlogged = router({"big": load(waiting=96, rate=10)})
    assert backlogged.answering("big", "free", takes_not_small) == "big"
    assert backlogged.answering("big", "free", takes=lambda m: True) == "small"
    no_worker = router({"big": load(workers=0)})
    with pytest.raises(ApiError) as caught:
        no_worker.answering("big", "free", takes=lambda m: m != "small")
    assert caught.value.status == 503


@pytest.mark.parametrize(("tier", "words", "status"), [("plus", 5000, 0), ("tiny", 5, 413)])
@pytest.mark.parametrize("client_context", [True, False], ids=["api", "chat"])
def test_a_request_that_can_never_pass_is_refused_as_such_while_the_model_is_busy(
    client_context: bool, tier: str, words: int, status: int
) -> None:
    """Longer than the model's window, or than the tier's whole minute of tokens: the
    4xx it gets when the model is free (OpenAI's 400 for an API client's context, the
    chat page's 413), not "busy, retry in 10 s", which an SDK retries for ever."""
    status = status or (400 if client_context else 413)
    asked = [ChatMessage(role="user", content="word " * words)]
    for busy_load in (load(workers=0), None):  # busy, and the same request when free
        route = router({"big": busy_load} if busy_load else {})
        checks = ReplyChecks(route.settings, DefaultModerator(), None)  # type: ignore[arg-type]
        with pytest.raises(ApiError) as caught:
            routed(
                route, checks, Request(tier, "big", asked, 256, "max_tokens", client_context, None)
            )
        assert caught.value.status == status, caught.value.message


def test_a_conversation_on_a_model_no_longer_configured_is_a_404_on_every_way_in() -> None:
    """Its context was asked of the model's config before the router's 404: a 500."""
    route = router({})
    checks = ReplyChecks(route.settings, DefaultModerator(), None)  # type: ignore[arg-type]
    asked = [ChatMessage(role="user", content="hi")]
    with pytest.raises(ApiError) as caught:
        routed(route, checks, Request("plus", "retired", asked, 256, "max_tokens", False, None))
    assert caught.value.status == 404 and "retired" in caught.value.message


def test_a_tier_in_the_batch_band_is_refused_on_interactive_routes() -> None:
    """Its prompts went to the batch band past admission's fair share."""
    route = router({})
    checks = ReplyChecks(route.settings, DefaultModerator(), None)  # type: ignore[arg-type]
    asked = [ChatMessage(role="user", content="hi")]
    with pytest.raises(ApiError) as caught:
        routed(route, checks, Request("batch", "big", asked, 256, "max_tokens", True, None))
    assert (caught.value.status, caught.value.code) == (403, "batch_tier")
    assert routed(route, checks, Request("plus", "big", asked, 256, "max_tokens", True, None))
