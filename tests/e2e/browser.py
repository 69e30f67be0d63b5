"""Driving the chat page in headless Chromium (Debian's, through Playwright): the
browser and page fixtures (tests/e2e/conftest.py offers them), signing in, and waits
that follow what the page shows. Screenshots go to test-artifacts/screenshots/."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, Route, async_playwright, expect

from tandoor import PROJECT_ROOT
from tests.e2e.helpers import auth
from tests.e2e.stack import Stack
from tests.waiting import eventually

CHROMIUM = "/usr/bin/chromium"
# Headless on a machine without outside network: no background fetches, no GPU.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = PROJECT_ROOT / "test-artifacts" / "screenshots"
# What the page shows of its replies: waits follow it, since replies take seconds on one
# machine and a minute on another.
REPLIES = """() => ({
  count: document.querySelectorAll('.message.assistant').length,
  streaming: document.querySelectorAll('.message.assistant.streaming').length,
  streamed: [...document.querySelectorAll('.message.assistant.streaming .body')]
    .map(body => body.textContent).join(''),
  text: [...document.querySelectorAll('.message.assistant .body')]
    .map(body => body.textContent).join('\\n'),
})"""


def chromium() -> str:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/bootstrap.sh installs Debian's chromium")
    return CHROMIUM


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        yield browser
        await browser.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1200, "height": 800})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # The page keeps to its strict CSP: anything it blocks is reported here, and fails.
    page.on(
        "console",
        lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.on("console", lambda message: print("console:", message.text))
    page.on("response", lambda r: print("response:", r.request.method, r.url, r.status))
    yield page
    await context.close()
    assert not errors, f"JavaScript errors or CSP violations on the page: {errors}"


async def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=SHOTS / f"{name}.png", full_page=True)


async def sign_in(
    page: Page, stack: Stack, tier: str = "plus", url: str | None = None
) -> dict[str, str]:
    """Sign in with a new key of `tier`; returns its Authorization header."""
    headers = await auth(stack, tier)
    await page.goto(url or stack.url)
    await page.get_by_label("API key").fill(headers["Authorization"].removeprefix("Bearer "))
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#app")).to_be_visible()
    await page.get_by_label("Model", exact=True).select_option(stack.model)
    return headers


async def replies(page: Page) -> dict[str, Any]:
    shown: dict[str, Any] = await page.evaluate(REPLIES)
    shown["send"] = await page.get_by_role("button", name="Send", exact=True).is_visible()
    return shown


async def replies_over(page: Page, count: int = 0) -> None:
    """Until at least `count` replies are shown, none streams and Send is back (while one
    streams, Send is Stop)."""
    await eventually(
        lambda: replies(page),
        lambda shown: shown["count"] >= count and shown["send"] and not shown["streaming"],
        what=f"{count} replies, ended",
    )


async def reply_streaming(page: Page) -> None:
    """Until the streaming reply shows its first words."""
    await eventually(lambda: replies(page), lambda shown: shown["streamed"], what="a first token")


async def stop_if_running(page: Page) -> None:
    """Press Stop if it is shown, in one step in the page: a reply that ended between a
    visibility check and a click hid Stop, and the click waited 30 s for it."""
    await page.evaluate(
        "() => { const stop = document.getElementById('stop'); if (!stop.hidden) stop.click(); }"
    )


async def ask(page: Page, text: str) -> None:
    """Send once the previous reply is over."""
    await replies_over(page)
    await page.get_by_label("Message", exact=True).fill(text)
    await page.get_by_label("Message", exact=True).press("Enter")


async def held_until_set(page: Page, url: str) -> asyncio.Event:
    """Requests to `url` wait until the event returned is set."""
    let_go = asyncio.Event()

    async def held(route: Route) -> None:
        await let_go.wait()
        await route.continue_()

    await page.route(url, held)
    return let_go


async def sent_while_it_loads(
    page: Page, conversation: str, text: str, let_go: asyncio.Event
) -> None:
    """Click the chat (its load held by `let_go`), send `text`, then let its load go."""
    await page.locator(f'#conversation-list button[data-id="{conversation}"]').click()
    composer = page.get_by_label("Message", exact=True)
    await composer.fill(text)
    await composer.press("Enter")
    let_go.set()
