"""The chat page's finish, in headless Chromium against the whole stack: the header
follows the title the model gives, a reply stopped before any text, expired or cut at
the length limit says so, copy buttons copy what was stored, the dark theme follows the
system, the page does not scroll a reader away from what they read, each message shows
its time on hover, and a chat whose reply never came is asked for it once."""

from __future__ import annotations

import re
import signal
from datetime import datetime
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from consumers.history import HistoryWriter
from producers.gateway.conversations.protocol import provisional_title
from schemas.events import FinalEvent, Usage, now_ms
from tandoor.clients import cassandra_session
from tests.e2e.browser import ask, replies, replies_over, shot, sign_in
from tests.e2e.helpers import chat, new_conversation, stored_reply, unanswered
from tests.e2e.stack import Stack
from tests.waiting import eventually

pytestmark = pytest.mark.integration

LUMINANCE = """selector => {
  const [r, g, b] = getComputedStyle(document.querySelector(selector)).backgroundColor
    .match(/\\d+/g).map(Number);
  return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
}"""
SCROLL = """() => { const l = document.getElementById('messages');
  return {top: l.scrollTop, overflow: l.scrollHeight - l.clientHeight}; }"""


async def stored(stack: Stack, headers: dict[str, str], conversation: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        response = await http.get(f"/v1/conversations/{conversation}", headers=headers)
        assert response.status_code == 200, response.text
        return dict(response.json())


async def current_id(page: Page) -> str:
    found = await page.locator('#conversation-list button[aria-current="true"]').get_attribute(
        "data-id"
    )
    assert found, "no conversation is open"
    return found


async def test_the_header_follows_the_title_the_model_gives(stack: Stack, page: Page) -> None:
    headers = await sign_in(page, stack, tier="brief")  # a few tokens: the title is the point
    question = "What is the tallest mountain in Africa? Answer in one sentence."
    await ask(page, question)
    await replies_over(page, 1)
    conversation = await current_id(page)

    async def title() -> str:
        return str((await stored(stack, headers, conversation))["title"])

    provisional = provisional_title(question)
    given = await eventually(title, lambda t: t != provisional, what="the model's title")
    await expect(page.locator("#chat-title")).to_have_text(given, timeout=120_000)
    current = page.locator('#conversation-list button[aria-current="true"]')
    await expect(current).to_have_text(given)
    await shot(page, "09-header-follows-title")


async def test_a_reply_stopped_before_any_text_says_so(stack: Stack, page: Page) -> None:
    headers = await sign_in(page, stack)
    await page.get_by_label("Model", exact=True).select_option(stack.second)
    worker = stack.second_worker
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGSTOP)  # no token can come before the stop
    try:
        await ask(page, "Tell me about the moon.")
        await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
        # Woken before the gateway had the stop, the worker took the prompt and streamed
        # a first word ("Tell") before the cancel reached it.
        async with page.expect_response(
            lambda r: r.request.method == "POST" and r.url.endswith("/stop")
        ) as stopping:
            await page.get_by_role("button", name="Stop", exact=True).click()
        assert (await stopping.value).status == 202
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    await replies_over(page, 1)
    reply = page.locator(".message.assistant").last
    await expect(reply.locator(".body")).to_have_text("Stopped before any text.")
    await expect(reply.locator(".meta")).to_contain_text("stopped")
    await shot(page, "10-stopped-before-text")

    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        # Stored a moment after the page has its end: persistence writes it.
        (answer,) = [
            m
            for m in await stored_reply(http, headers, await current_id(page))
            if m["role"] == "assistant"
        ]
    assert (answer["status"], answer["content"]) == ("stopped", ""), answer
    await page.reload()  # the stored reply says the same
    await page.locator("#conversation-list button").first.click()
    await expect(page.locator(".message.assistant .body")).to_have_text("Stopped before any text.")


async def test_a_reply_that_expired_in_the_queue_says_so(stack: Stack, page: Page) -> None:
    """No worker took the prompt before its deadline: the reply is stored "expired",
    without text. Opened again, the chat showed an empty bubble and no word of why."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        conversation_id = await new_conversation(http, headers, stack.model)
    user_id = await unanswered(stack, conversation_id, "m_late", "Name a colour.")
    asked_at = now_ms()
    expired = FinalEvent(
        request_id="m_late",
        attempt=1,
        seq=0,
        finish_reason="expired",
        error="the deadline passed before the worker took the prompt",
        text="",
        usage=Usage(prompt_tokens=0, completion_tokens=0, queue_ms=30_000, decode_ms=0),
        model=stack.model,
        user_id=user_id,
        tier="plus",
        conversation_id=conversation_id,
        created_at_ms=asked_at,
        prompt_created_at_ms=asked_at,
    )
    with cassandra_session(stack.settings, stack.settings.keyspace) as session:
        await HistoryWriter(session).store(expired)  # as the persistence consumer does
    await page.reload()
    await page.locator(f'#conversation-list button[data-id="{conversation_id}"]').click()
    reply = page.locator(".message.assistant")
    await expect(reply.locator(".body")).to_have_text(
        "No reply: the model was too busy to start it in time."
    )
    await expect(reply.locator(".meta")).to_contain_text("expired")


async def test_a_reply_cut_at_the_length_limit_says_so(stack: Stack, page: Page) -> None:
    """Stopped by its token limit mid-sentence, it looked like a finished reply."""
    await sign_in(page, stack, tier="brief")  # replies of at most 8 tokens
    await ask(page, "Tell me a long story about a lighthouse keeper and the sea.")
    await replies_over(page, 1)
    cut = "cut at the length limit"
    await expect(page.locator(".message.assistant .meta")).to_contain_text(cut)
    await page.reload()
    await page.locator("#conversation-list button").first.click()
    await expect(page.locator(".message.assistant .meta")).to_contain_text(cut)
    await expect(page.locator(".message.assistant .body")).not_to_have_text("")


async def test_copy_buttons_and_message_times(stack: Stack, page: Page) -> None:
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack.url)
    headers = await sign_in(page, stack, tier="brief")
    await ask(page, "Name three rivers in Europe.")
    await replies_over(page, 1)
    conversation = await stored(stack, headers, await current_id(page))
    asked, answer = conversation["messages"][-2:]

    await page.get_by_role("button", name="Copy this reply").click()
    await expect(page.get_by_role("button", name="Copy this reply")).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == answer["content"]
    await shot(page, "12-reply-copied")

    # A code block's button copies the code alone, as the page renders replies.
    code = await page.evaluate(
        """async () => {
          const { renderMarkdown } = await import('/web/markdown.js');
          const { addCodeCopyButtons } = await import('/web/copy.js');
          const body = document.createElement('div');
          body.innerHTML = renderMarkdown('Run:\\n```py\\nprint("a < b")\\n```\\nDone.');
          addCodeCopyButtons(body);
          document.getElementById('messages').append(body);
          const button = body.querySelector('button.copy');
          button.click();
          while (button.textContent === 'Copy') await new Promise(r => setTimeout(r, 10));
          return navigator.clipboard.readText();
        }"""
    )
    assert code == 'print("a < b")'

    # Hovering a message shows when it was sent: the stored time, after a reload too.
    await page.reload()
    await page.locator("#conversation-list button").first.click()
    mine = page.locator(".message.user").last
    time = mine.locator(".meta time")
    assert await time.evaluate("t => getComputedStyle(t).opacity") == "0"
    await mine.hover()
    await eventually(
        lambda: time.evaluate("t => getComputedStyle(t).opacity"),
        lambda opacity: opacity == "1",
        what="the time shown on hover",
    )
    shown_at = datetime.fromisoformat(str(await time.get_attribute("datetime")))
    assert shown_at == datetime.fromisoformat(asked["created_at"]), (shown_at, asked)
    await shot(page, "13-message-time-on-hover")


async def test_the_dark_theme_follows_the_system(stack: Stack, page: Page) -> None:
    await sign_in(page, stack, tier="brief")
    assert await page.evaluate(LUMINANCE, "body") > 0.8
    await page.emulate_media(color_scheme="dark")
    assert await page.evaluate(LUMINANCE, "body") < 0.2
    await ask(page, "Say hello.")
    await replies_over(page, 1)
    assert await page.evaluate(LUMINANCE, ".message.assistant") < 0.2
    await shot(page, "11-dark-theme")


async def test_a_reader_scrolled_up_is_not_pulled_down(stack: Stack, page: Page) -> None:
    await page.set_viewport_size({"width": 1000, "height": 420})
    await sign_in(page, stack)
    latest = page.get_by_role("button", name="Scroll to the latest message")
    await ask(page, "Write a long story about a lighthouse keeper and the sea.")
    # Followed to the end while it streams: no button in the way.
    await eventually(
        lambda: page.evaluate(SCROLL),
        lambda scroll: scroll["overflow"] > 100,
        what="a reply taller than the list",
    )
    await expect(latest).to_be_hidden()
    assert (await replies(page))["streaming"], "the reply ended too soon to scroll away from it"

    await page.locator("#messages").evaluate("list => list.scrollTo(0, 0)")
    await expect(latest).to_be_visible()
    before = (await replies(page))["streamed"]
    await eventually(
        lambda: replies(page),
        lambda shown: len(shown["streamed"]) > len(before) + 20,
        what="more of the reply, streamed while the reader is scrolled up",
    )
    assert (await page.evaluate(SCROLL))["top"] == 0, "the reader was pulled down"
    await shot(page, "14-scroll-to-latest")

    await latest.click()
    await expect(latest).to_be_hidden()
    position = await page.evaluate(SCROLL)
    assert position["overflow"] - position["top"] < 40, position
    await page.keyboard.press("Escape")
    await replies_over(page, 1)


async def test_every_error_is_said_once(stack: Stack, page: Page) -> None:
    """A 413 (no wait to suggest) and a 503 whose message carries the gateway's own
    "retry in N s": each said once, in the page's words."""
    await sign_in(page, stack)
    await ask(page, "word " * 5000)  # past the model's context: refused before any reply
    await expect(page.get_by_role("alert").filter(has_text="too long")).to_be_visible()
    await expect(page.locator(".message.assistant")).to_have_count(0)
    await expect(page.locator(".message.user")).to_have_count(0)
    (too_long,) = await alerts(page)
    assert too_long.count("too long") == 1, too_long
    await shot(page, "15-error-said-once")

    await page.get_by_role("button", name="New chat").click()
    await page.get_by_label("Model", exact=True).select_option(stack.idle)  # no worker
    await ask(page, "Hello?")
    await expect(page.get_by_role("alert").filter(has_text="busy")).to_be_visible()
    (busy,) = await alerts(page)
    pattern = r"The service is busy or unavailable: .+\. Try again in \d+ seconds?\."
    assert re.fullmatch(pattern, busy), busy
    assert "retry" not in busy.lower() and busy.count("Try again") == 1, busy

    # Unreachable: the page's own message was cut as a gateway's "retry" ("...and.").
    await page.route("**/v1/conversations", lambda route: route.abort())
    await page.get_by_role("button", name="New chat").click()
    await ask(page, "Hello?")
    await expect(page.get_by_role("alert").filter(has_text="cannot be reached")).to_be_visible()
    (unreachable,) = await alerts(page)
    assert unreachable == "The gateway cannot be reached. Check your connection and retry."


async def alerts(page: Page) -> list[str]:
    """The alerts showing, by their text."""
    return [t for t in await page.get_by_role("alert").all_inner_texts() if t.strip()]


async def test_a_chat_whose_reply_never_came_asks_for_it_once(stack: Stack, page: Page) -> None:
    """A gateway that died after storing the message, before queueing it: the page asks
    for the running reply, hears that none runs, looks for a stored one a few times and
    stops. It asked again and again, request after request, for as long as it was open."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        created = await http.post("/v1/conversations", json={"title": "orphan"}, headers=headers)
        conversation_id = created.json()["id"]
    await unanswered(stack, conversation_id, "m_orphan", "Is anyone there?")
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    await page.reload()
    await page.locator(f'#conversation-list button[data-id="{conversation_id}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text("Is anyone there?")

    async def opened_times() -> int:
        return sum(url.endswith(f"/v1/conversations/{conversation_id}") for url in asked)

    # Opened, then looked at once a second for a stored reply, five times.
    await eventually(opened_times, lambda n: n >= 6, what="the page's looks for a reply")
    await page.wait_for_timeout(2500)  # and then no more (it looked once a second)
    assert await opened_times() == 6, asked
    assert sum(url.endswith("/stream") for url in asked) == 1, asked
    await expect(page.get_by_role("button", name="Send", exact=True)).to_be_visible()
    # Said, and Regenerate offered: with no reply to regenerate it was hidden, and the
    # question, sent again, was stored twice.
    await expect(page.locator("#notice")).to_contain_text("No reply to your last message yet")
    await page.get_by_role("button", name="Regenerate").click()
    await replies_over(page, 1)
    messages = (await stored(stack, headers, conversation_id))["messages"]
    assert [m["role"] for m in messages if m["status"] != "replaced"] == ["user", "assistant"]


async def reply_running(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    """A new chat whose first reply runs at the gateway, not followed by the page."""
    conversation = await new_conversation(http, headers)
    body = {"content": "Count from one to twenty in words.", "max_tokens": 64}
    path = f"/v1/conversations/{conversation}/messages"
    async with http.stream("POST", path, json=body, headers=headers) as started:
        assert started.status_code == 200
        await anext(started.aiter_lines())  # queued: closing is not stop
    return conversation


async def test_a_running_reply_opened_through_a_proxys_502_is_shown_whole(
    stack: Stack, page: Page
) -> None:
    """Opening a chat whose reply runs asked for its stream once: a proxy's 502 in a
    rolling restart (or a dropped connection) left no reply shown, and Escape then
    posted a Stop that answered 404. A saved key is kept through a failed sign-in."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        conversation = await reply_running(http, headers)
        failed: list[str] = []

        async def first_fails(route: Route) -> None:
            if failed:
                await route.continue_()
                return
            failed.append(route.request.url)
            await route.fulfill(status=502, body="Bad Gateway")

        await page.route("**/v1/models", first_fails)  # the sign-in the reload does
        await page.reload()
        await expect(page.locator("#signin-error")).to_contain_text("Bad Gateway")
        await page.unroute("**/v1/models")
        await page.get_by_role("button", name="Sign in").click()  # the key was kept
        await expect(page.locator("#app")).to_be_visible()
        failed.clear()
        await page.route("**/stream", first_fails)
        chat = page.locator(f'#conversation-list button[data-id="{conversation}"]')
        await chat.click()
        await replies_over(page, 1)
        assert failed, "the stream was never asked for"
        await stored_reply(http, headers, conversation)
    shown = await page.locator(".message.assistant .body").inner_text()
    await page.reload()  # the stored reply, as the page shows it
    await chat.click()
    stored = page.locator(".message.assistant .body")  # both read as innerText: paragraphs
    await expect(stored).to_have_text(shown, use_inner_text=True)  # keep their blank line
    assert shown.strip()


async def test_regenerating_a_question_left_unanswered_keeps_the_earlier_reply(
    stack: Stack, page: Page
) -> None:
    """The gateway answers the last question sent and replaces only what follows it;
    the page took the last reply shown away instead, the earlier question's, until
    the chat was opened again."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        conversation_id = await new_conversation(http, headers)
        await chat(http, headers, conversation_id, "Say hi.", 4)
    await unanswered(stack, conversation_id, "m_unanswered", "Name a colour.")
    await page.reload()
    await page.locator(f'#conversation-list button[data-id="{conversation_id}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi.", "Name a colour."])
    send = page.get_by_role("button", name="Send", exact=True)
    await expect(send).to_be_visible(timeout=30_000)  # done looking for its reply
    earlier = await page.locator(".message.assistant .body").inner_text()
    await page.get_by_role("button", name="Regenerate").click()
    await replies_over(page, 2)
    await expect(page.locator(".message .body").first).to_have_text("Say hi.")
    shown = page.locator(".message")
    await expect(shown).to_have_count(4)
    assert await page.locator(".message.assistant .body").first.inner_text() == earlier
