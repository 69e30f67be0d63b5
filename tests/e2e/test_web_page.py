"""The chat page in headless Chromium (Debian's, driven by Playwright) against the
whole stack: sign in, watch a reply stream, stop, regenerate, reload and find the
chat in the sidebar. Screenshots go to test-artifacts/screenshots/."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from infra.process import free_port
from infra.roles import GatewayProcess
from tandoor import PROJECT_ROOT
from tests.e2e.helpers import auth, chat, new_conversation
from tests.e2e.stack import Stack
from tests.waiting import eventually

pytestmark = pytest.mark.integration

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
    page.on("console", lambda message: print("console:", message.text))
    page.on("response", lambda r: print("response:", r.request.method, r.url, r.status))
    yield page
    await context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


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
    shown["send"] = await page.get_by_role("button", name="Send").is_visible()
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


async def ask(page: Page, text: str) -> None:
    """Send once the previous reply is over."""
    await replies_over(page)
    await page.get_by_label("Message", exact=True).fill(text)
    await page.get_by_label("Message", exact=True).press("Enter")


async def test_chat_stop_regenerate_and_reload(stack: Stack, page: Page) -> None:
    await sign_in(page, stack)
    await shot(page, "01-signed-in")

    # Tokens arrive one update after another, then the reply is complete.
    await page.evaluate(
        """() => {
        window.seen = [];
        new MutationObserver(() => {
          const body = document.querySelector('.message.assistant .body');
          if (body) window.seen.push(body.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true,
                                                         characterData: true});
      }"""
    )
    await ask(page, "What is the capital of France? Answer in one sentence.")
    reply = page.locator(".message.assistant").last
    await replies_over(page, 1)
    await expect(reply.locator(".body")).not_to_be_empty()  # sampled: the words may vary
    first_answer = await reply.locator(".body").inner_text()
    lengths = await page.evaluate("window.seen")
    assert len({n for n in lengths if n}) >= 2, f"the reply did not stream: {lengths}"
    await shot(page, "02-reply")

    # Stop mid-answer: the partial reply stays, marked stopped.
    await ask(page, "Write a very long story about the sea, with many chapters.")
    await reply_streaming(page)
    await page.get_by_role("button", name="Stop").click()
    stopped = page.locator(".message.assistant").last
    await replies_over(page, 2)
    await expect(stopped.locator(".meta")).to_contain_text("stopped")
    await shot(page, "03-stopped")

    # Regenerate: the stopped reply is replaced by a fresh one.
    await page.get_by_role("button", name="Regenerate").click()
    await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
    await page.keyboard.press("Escape")  # stop it too, from the keyboard
    await replies_over(page)
    await expect(page.locator(".message.assistant")).to_have_count(2)
    await shot(page, "04-regenerated")

    # Reload: still signed in for this tab, and the chat is in the sidebar.
    await page.reload()
    newest = page.locator("#conversation-list button").first  # its title may be the model's now
    await expect(newest).to_be_visible()
    await newest.click()
    await expect(page.locator(".message.assistant .body").first).to_have_text(first_answer)
    await expect(page.locator(".message.user")).to_have_count(2)
    await shot(page, "05-reloaded")


async def test_over_quota_says_when_to_retry(stack: Stack, page: Page) -> None:
    headers = await sign_in(page, stack, tier="free")  # two requests a minute in this stack
    # The minute's two requests, spent through the API on one-token replies: done in
    # seconds on any CPU, well inside the sliding minute.
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        for question in ["Say hi.", "Say bye."]:
            await chat(http, headers, await new_conversation(http, headers), question, 1)
    await ask(page, "Say hello again.")
    notice = page.get_by_role("alert").filter(has_text="Too many requests")
    await expect(notice).to_be_visible()
    await expect(notice).to_contain_text(re.compile(r"Try again in \d+ seconds"))
    await expect(page.locator(".message.assistant")).to_have_count(0)
    await shot(page, "06-over-quota")


async def test_replies_are_rendered_as_escaped_markdown(stack: Stack, page: Page) -> None:
    await page.goto(stack.url)
    html = await page.evaluate(
        """async () => (await import('/web/markdown.js')).renderMarkdown(
          '<img src=x onerror=alert(1)> **bold** and `<b>`\\n```py\\nprint("<hi>")\\n```')"""
    )
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "<code>&lt;b&gt;</code>" in html
    assert '<pre><code class="language-py">print(&quot;&lt;hi&gt;&quot;)</code></pre>' in html


async def test_the_model_picker_sends_to_the_model_chosen(stack: Stack, page: Page) -> None:
    await sign_in(page, stack, tier="brief")  # short replies: Gemma is slow on a CPU
    picker = page.get_by_label("Model", exact=True)
    offered = await picker.locator("option").all_inner_texts()
    assert {stack.model, stack.second} <= set(offered), offered
    await picker.select_option(stack.second)
    await ask(page, "Name a colour.")
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant .meta").last).to_contain_text(stack.second)
    await expect(page.locator("#chat-model")).to_have_text(stack.second)
    await shot(page, "08-second-model")


async def test_edit_rename_and_delete(stack: Stack, page: Page) -> None:
    await sign_in(page, stack)
    await ask(page, "What is 2 + 2?")
    await replies_over(page, 1)

    await page.get_by_role("button", name="Edit this message").click()
    await page.get_by_label("Edited message").fill("What is the capital of Italy?")
    await page.get_by_role("button", name="Save and rerun").click()
    await replies_over(page)
    await expect(page.locator(".message.user")).to_have_text(re.compile("capital of Italy"))
    await expect(page.locator(".message.assistant")).to_have_count(1)
    await expect(page.locator(".message.assistant .body")).not_to_be_empty()
    await page.reload()  # what was stored: the edited question and its one reply
    await page.locator("#conversation-list button").first.click()
    await expect(page.locator(".message.user")).to_have_text(re.compile("capital of Italy"))
    await expect(page.locator(".message.assistant")).to_have_count(1)

    page.once("dialog", lambda dialog: dialog.accept("Italian geography"))
    await page.get_by_role("button", name="Rename").click()
    await expect(page.locator("#conversation-list")).to_contain_text("Italian geography")
    await shot(page, "07-edited-and-renamed")

    page.once("dialog", lambda dialog: dialog.accept())
    await page.get_by_role("button", name="Delete").click()
    await expect(page.locator("#conversation-list button")).to_have_count(0)
    await expect(page.locator("#chat-title")).to_have_text("New chat")


async def test_a_gateway_restart_mid_reply_resumes_it(stack: Stack, page: Page) -> None:
    """kill -9 of the page's gateway mid-reply: the page reconnects to its successor
    with Last-Event-ID and shows the whole reply, nothing twice."""
    port = free_port()
    env = {**stack.env, "TANDOOR_REPLY_MAX_TOKENS": "160"}  # long enough to cut, no longer
    first, second = (GatewayProcess(stack.logs, port, env) for _ in range(2))
    first.start()
    try:
        await first.wait_ready()
        await sign_in(page, stack, url=f"http://127.0.0.1:{port}")
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        await ask(page, "Write a long story about a lighthouse keeper.")
        await reply_streaming(page)
        first.kill()
        second.start()
        await second.wait_ready()
        await replies_over(page)
        assert any(url.endswith("/stream") for url in requested), "the page never reconnected"
        shown = await page.locator(".message.assistant .body").inner_text()
        await page.reload()
        await page.locator("#conversation-list button").first.click()
        stored = await page.locator(".message.assistant .body").inner_text()
        assert shown == stored and len(stored) > 100, "the whole reply, nothing twice"
        await page.get_by_role("button", name="Regenerate").click()  # no reply left running
        await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
    finally:  # no drain: the regenerated reply would hold it for its whole length
        first.kill()
        second.kill()
