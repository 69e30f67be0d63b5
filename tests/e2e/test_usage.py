"""GET /v1/usage and the page's usage view against the whole stack: a user's requests
and tokens as stored from the usage stream, their tier's limits and what is used of
each now, and nobody else's."""

from __future__ import annotations

import datetime as dt
import re
import signal
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from tests.e2e.browser import ask, replies_over, shot, sign_in
from tests.e2e.helpers import auth, stored_reply
from tests.e2e.stack import Stack
from tests.waiting import eventually

pytestmark = pytest.mark.integration

QUESTIONS = ["Say yes.", "Say no."]


async def usage(http: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, Any]:
    response = await http.get("/v1/usage", headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def completions(http: httpx.AsyncClient, stack: Stack, headers: dict[str, str]) -> int:
    """One short completion per question; the tokens they used, as each reply said."""
    used = 0
    for question in QUESTIONS:
        body = {
            "model": stack.model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 4,
        }
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        used += response.json()["usage"]["total_tokens"]
    return used


async def stored(http: httpx.AsyncClient, headers: dict[str, str], requests: int) -> dict[str, Any]:
    """The caller's usage once `requests` are stored (the persistence consumer is behind)."""
    return await eventually(
        lambda: usage(http, headers),
        lambda found: found["today"]["requests"] >= requests,
        what=f"{requests} requests in /v1/usage",
    )


async def test_usage_counts_the_callers_own_requests_and_limits(stack: Stack) -> None:
    mine, other = await auth(stack, "plus"), await auth(stack, "plus")
    policy = stack.settings.tiers["plus"]
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        assert (await http.get("/v1/usage")).status_code == 401
        tokens = await completions(http, stack, mine)
        limits = (await usage(http, mine))["limits"]  # seconds after: inside the minute
        found = await stored(http, mine, len(QUESTIONS))
        nobody = await usage(http, other)

    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert [d["day"] for d in found["days"]][-1] == today and len(found["days"]) == 7
    assert found["today"]["requests"] == len(QUESTIONS)
    assert found["today"]["total_tokens"] == tokens
    assert found["last_7_days"] == {**found["today"], "day": found["days"][0]["day"]}
    assert limits["requests_per_minute"] == {
        "limit": policy.requests_per_minute,
        "used": len(QUESTIONS),
    }
    assert limits["tokens_per_minute"]["limit"] == policy.tokens_per_minute
    assert limits["tokens_per_minute"]["used"] is not None  # Redis is up: known
    assert limits["concurrent_streams"] == {"limit": policy.concurrent_streams, "used": 0}
    assert found["tier"] == "plus"
    assert (
        nobody["last_7_days"]["requests"] == 0
        and nobody["limits"]["requests_per_minute"]["used"] == 0
    ), "another user's usage shows none of this user's"


async def test_the_usage_page_shows_what_the_api_says(stack: Stack, page: Page) -> None:
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        await completions(http, stack, headers)
        await stored(http, headers, len(QUESTIONS))
        await page.get_by_role("button", name="Your usage").click()
        await expect(page.locator("#usage-title")).to_be_visible()
        await expect(page.locator("#usage-today-requests")).to_have_text(str(len(QUESTIONS)))
        shown = await page.evaluate(
            """() => ({
              today: [document.getElementById('usage-today-requests').textContent,
                      document.getElementById('usage-today-tokens').textContent],
              week: [document.getElementById('usage-week-requests').textContent,
                     document.getElementById('usage-week-tokens').textContent],
              bars: [...document.querySelectorAll('#usage-chart rect')]
                .map(r => [r.dataset.day, Number(r.dataset.tokens)]),
              limits: [...document.querySelectorAll('#usage-limits tr')]
                .map(row => [...row.cells].slice(0, 3).map(c => c.textContent)),
            })"""
        )
        api = await usage(http, headers)
    await shot(page, "16-usage-page")

    def figure(text: str) -> int:
        return int(re.sub(r"\D", "", text))

    assert [figure(t) for t in shown["today"]] == [
        api["today"]["requests"],
        api["today"]["total_tokens"],
    ]
    assert [figure(t) for t in shown["week"]] == [
        api["last_7_days"]["requests"],
        api["last_7_days"]["total_tokens"],
    ]
    assert shown["bars"] == [[d["day"], d["total_tokens"]] for d in api["days"]]
    allowed = {row[0]: figure(row[2]) for row in shown["limits"]}
    assert allowed == {
        "Requests per minute": api["limits"]["requests_per_minute"]["limit"],
        "Tokens per minute": api["limits"]["tokens_per_minute"]["limit"],
        "Replies streaming at once": api["limits"]["concurrent_streams"]["limit"],
    }
    used = {row[0]: figure(row[1]) for row in shown["limits"]}
    # Read a moment before the API's answer: the sliding minute can only have let go since.
    assert used["Requests per minute"] >= api["limits"]["requests_per_minute"]["used"]
    assert used["Requests per minute"] <= len(QUESTIONS)


async def test_escape_closes_the_usage_view_and_leaves_the_reply_running(
    stack: Stack, page: Page
) -> None:
    """Escape on the usage view stopped the reply streaming out of sight behind it."""
    headers = await sign_in(page, stack, tier="brief")
    await page.get_by_label("Model", exact=True).select_option(stack.second)
    worker = stack.second_worker
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGSTOP)  # the reply runs on while the view is open
    try:
        await ask(page, "Name a colour.")
        await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
        await page.get_by_role("button", name="Your usage").click()
        await expect(page.locator("#usage-title")).to_be_visible()
        await page.keyboard.press("Escape")
        await expect(page.locator("#usage")).to_be_hidden()
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant .meta")).not_to_contain_text("stopped")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
        stored = await stored_reply(http, headers, listed[0]["id"])
    assert stored[-1]["role"] == "assistant" and stored[-1]["status"] == "complete", stored
