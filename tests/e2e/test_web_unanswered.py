"""The chat page when a message's answer never reaches it (a dropped connection, a
proxy's 502, or a refusal that comes once the chat was left): shown sent where the
gateway took it, back in the composer where not; and a sign-in whose chats could not be
listed says why; a resume refused with Retry-After waits as asked. In headless Chromium
against the whole stack."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from tests.e2e.browser import ask, replies, replies_over, sign_in
from tests.e2e.helpers import auth, stored_reply
from tests.e2e.stack import BLOCKED_TERM, Stack
from tests.e2e.stalling_proxy import StallingProxy
from tests.e2e.test_web_polish import reply_running

pytestmark = pytest.mark.integration

MESSAGES = "**/v1/conversations/*/messages"


def answer_lost(max_tokens: int) -> Callable[[Route], Awaitable[None]]:
    """A route for MESSAGES: the gateway takes the message and streams its whole reply
    (short: the page shows nothing meanwhile, and a wait for it sees no progress), and
    the page gets a 502."""

    async def lost(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        short = {**(route.request.post_data_json or {}), "max_tokens": max_tokens}
        await route.fetch(post_data=json.dumps(short), timeout=0)
        await route.fulfill(status=502, body="Bad Gateway")

    return lost


def one_conversation(url: str) -> bool:
    """GET /v1/conversations/{id}: the chat as stored."""
    return re.search(r"/v1/conversations/c_[0-9a-f]+$", url) is not None


@pytest.mark.parametrize(
    "text", ["Say hi.", "Say hi to ann@example.com."], ids=["plain", "redacted"]
)
async def test_a_message_the_gateway_took_is_shown_sent_though_its_answer_was_lost(
    stack: Stack, page: Page, text: str
) -> None:
    """The gateway queued it and streamed the reply, but the page got a 502: it took the
    message as refused, took the question off and put its text back in the composer,
    while the reply ran out of sight (and, sent again, the question was stored twice).
    Stored redacted, it is not the text sent, and is still found sent."""
    await sign_in(page, stack)
    await page.route(MESSAGES, answer_lost(max_tokens=16))
    await ask(page, text)
    await replies_over(page, 1)
    await expect(page.locator(".message.user")).to_have_count(1)
    assert (await replies(page))["text"].strip(), "the reply is not shown"
    await expect(page.get_by_label("Message", exact=True)).to_have_value("")
    await expect(page.locator("#notice")).to_be_hidden()


@pytest.mark.parametrize("text", ["Say bye.", "Say hi."], ids=["new", "as-an-earlier-question"])
async def test_a_message_that_never_reached_the_gateway_goes_back_to_the_composer(
    stack: Stack, page: Page, text: str
) -> None:
    """Asked after the drop, the gateway runs no reply and stores no such message: the
    text comes back, and the page says it was not sent (the same text asked earlier is
    not this message)."""
    await sign_in(page, stack)
    await ask(page, "Say hi.")
    await replies_over(page, 1)

    async def dropped(route: Route) -> None:
        if route.request.method == "POST":
            await route.abort("connectionreset")
        else:
            await route.continue_()

    await page.route(MESSAGES, dropped)
    await ask(page, text)
    await expect(page.locator("#notice")).to_contain_text("not sent")
    await expect(page.get_by_label("Message", exact=True)).to_have_value(text)
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])


async def test_a_message_sent_while_the_gateway_stays_unreachable_keeps_its_text(
    stack: Stack, page: Page
) -> None:
    """Unanswered, then every try to find its reply failed too: the question stayed shown
    as sent, the composer empty, and reopening the chat (as the notice said) lost it."""
    await sign_in(page, stack)
    await ask(page, "Say hi.")
    await replies_over(page, 1)

    async def unreachable(route: Route) -> None:
        await route.abort("connectionreset")

    for path in (MESSAGES, "**/v1/conversations/*", "**/v1/conversations/*/stream"):
        await page.route(path, unreachable)
    await ask(page, "Say bye.")
    # After the page's resume tries (about 15 s of backing off).
    composer = page.get_by_label("Message", exact=True)
    await expect(composer).to_have_value("Say bye.", timeout=120_000)
    await expect(page.locator("#notice")).to_contain_text("may not have been sent")
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])


async def test_a_reply_whose_connection_went_silent_is_resumed_and_shown_whole(
    stack: Stack, page: Page
) -> None:
    """The stream stopped mid-reply without closing (a laptop's sleep, a NAT's dropped
    mapping): the page waited on it for good, the reply streaming with no end. After a
    silence longer than the gateway's keep-alives it gives the stream up and resumes."""
    async with StallingProxy(stack.url, marker=b'"type":"token"').serving() as proxy:
        await sign_in(page, stack, url=proxy.url)
        await ask(page, "Tell me about the sea.")
        await replies_over(page, 1)  # 45 s of silence, then the resume
        assert proxy.stalled == 1, "the reply's stream was never silenced"
        await expect(page.locator("#notice")).to_be_hidden()
        shown = await page.locator(".message.assistant .body").inner_text()
        await page.reload()  # the stored reply, as the page shows it
        await page.locator("#conversation-list button").first.click()
        stored = page.locator(".message.assistant .body")
        await expect(stored).to_have_count(1)
        await expect(stored).not_to_have_text("")
        assert shown == await stored.inner_text()


async def test_a_message_refused_after_its_chat_was_left_comes_back_and_is_said(
    stack: Stack, page: Page
) -> None:
    """The refusal came once "New chat" was clicked: the page dropped it, and the text
    typed was gone without a word (nothing was stored either)."""
    await sign_in(page, stack)
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    left = asyncio.Event()

    async def answered_late(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        refusal = await route.fetch()  # the gateway's own answer: moderation's 400
        await left.wait()
        await route.fulfill(response=refusal)

    await page.route(MESSAGES, answered_late)
    text = f"Tell me about {BLOCKED_TERM}."
    await ask(page, text)
    await page.get_by_role("button", name="New chat").click()
    left.set()
    await expect(page.locator("#notice")).to_contain_text("Not sent to the chat you left")
    await expect(page.get_by_label("Message", exact=True)).to_have_value(text)
    await expect(page.locator(".message")).to_have_count(0)  # the new chat stays empty


async def test_a_sign_in_whose_chats_cannot_be_listed_says_why(stack: Stack, page: Page) -> None:
    """The key was taken and the app shown, then the list of chats failed (a proxy's
    502 in a rolling restart): its error went into the hidden sign-in form, and the
    user saw an app with no chats and no word of why."""
    headers = await auth(stack)

    async def list_fails(route: Route) -> None:
        await route.fulfill(status=502, body="Bad Gateway")

    await page.route("**/v1/conversations?*", list_fails)
    await page.goto(stack.url)
    await page.get_by_label("API key").fill(headers["Authorization"].removeprefix("Bearer "))
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#signin-error")).to_contain_text("Bad Gateway")
    await expect(page.locator("#app")).to_be_hidden()
    await page.unroute("**/v1/conversations?*")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#app")).to_be_visible()


async def test_no_stop_is_offered_while_an_ended_reply_is_looked_for(
    stack: Stack, page: Page
) -> None:
    """Its answer lost, the reply had ended when the page asked for its stream (a 404:
    no reply runs), and while the page looked for the stored reply it showed Stop,
    which stopped nothing (a press flashed "no reply is being generated")."""
    await sign_in(page, stack)
    looking, let_go = asyncio.Event(), asyncio.Event()

    async def stored_read_held(route: Route) -> None:
        looking.set()
        await let_go.wait()
        await route.continue_()

    async def reply_ended(route: Route) -> None:
        await page.route(one_conversation, stored_read_held)  # what the page reads next
        gone = {"error": {"message": "no reply is being generated in this conversation"}}
        await route.fulfill(status=404, json=gone)

    await page.route(MESSAGES, answer_lost(max_tokens=4))
    await page.route("**/v1/conversations/*/stream", reply_ended)
    await ask(page, "Say hi.")
    await asyncio.wait_for(looking.wait(), 120)
    try:
        await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_hidden()
    finally:
        let_go.set()
    await replies_over(page, 1)
    await expect(page.locator("#notice")).to_be_hidden()


async def test_a_resume_refused_with_retry_after_waits_as_asked(stack: Stack, page: Page) -> None:
    """A resume refused by a draining or full replica (503, Retry-After: 3) was tried
    again after the page's own half-second pause, whatever the gateway asked."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        conversation = await reply_running(http, headers)
        asked_at: list[float] = []

        async def first_refused(route: Route) -> None:
            asked_at.append(time.monotonic())
            if len(asked_at) > 1:
                await route.continue_()
                return
            error = {"message": "this gateway replica is shutting down", "type": "x"}
            await route.fulfill(status=503, json={"error": error}, headers={"Retry-After": "3"})

        await page.route("**/v1/conversations/*/stream", first_refused)
        await page.reload()  # signed in again with the saved key: the new chat is listed
        await page.locator(f'#conversation-list button[data-id="{conversation}"]').click()
        await replies_over(page, 1)
        await stored_reply(http, headers, conversation)
    assert len(asked_at) >= 2, asked_at
    assert asked_at[1] - asked_at[0] >= 3.0, asked_at
