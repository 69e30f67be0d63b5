"""The chat page's reruns (regenerate, edit) when their answer is lost or the chat is left
meanwhile: the reply the gateway runs is the one shown, and an edit that never reached it
comes back to its editor. In headless Chromium against the whole stack."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from tests.e2e.browser import ask, replies, replies_over, reply_streaming, sign_in
from tests.e2e.helpers import chat, new_conversation
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration

REGENERATE = "**/v1/conversations/*/regenerate"
EDIT = "**/v1/conversations/*/messages/*/edit"


def posted_with(
    options: dict[str, object], then_lost: bool = False
) -> Callable[[Route], Awaitable[None]]:
    """A rerun sent with `options`; `then_lost`: the gateway takes it and streams its
    whole reply, and the page gets a proxy's 502."""

    async def handle(route: Route) -> None:
        body = json.dumps({**(route.request.post_data_json or {}), **options})
        if not then_lost:
            await route.continue_(post_data=body)
            return
        await route.fetch(post_data=body, timeout=0)
        await route.fulfill(status=502, body="Bad Gateway")

    return handle


async def answered(page: Page, text: str) -> None:
    await ask(page, text)
    await replies_over(page, 1)


async def test_a_chat_reopened_while_its_regenerated_reply_runs_follows_it(
    stack: Stack, page: Page
) -> None:
    """The replaced reply, hidden, was still the chat's last message: reopened, the chat
    showed the question with no reply, no stream and no Stop, and sending was refused
    (a reply runs) while nothing said so."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        other = await new_conversation(http, headers)
        await chat(http, headers, other, "Say hi.", 4)
    await answered(page, "Say hi.")
    running = await page.locator('#conversation-list button[aria-current="true"]').get_attribute(
        "data-id"
    )
    await page.route(REGENERATE, posted_with({"max_tokens": 400, "ignore_eos": True}))
    await page.get_by_role("button", name="Regenerate").click()
    await reply_streaming(page)
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])

    await page.locator(f'#conversation-list button[data-id="{running}"]').click()
    await expect(page.locator(".message.assistant")).to_have_count(1)
    await expect(page.locator(".message.assistant .body")).not_to_be_empty()
    await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_visible()
    await page.get_by_role("button", name="Stop", exact=True).click()
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant")).to_have_count(1)


async def test_a_regenerate_whose_answer_was_lost_shows_its_reply(stack: Stack, page: Page) -> None:
    """Taken as refused: the chat was reopened as stored (its old reply hidden, the new
    one not stored yet: no reply at all) and "Bad Gateway." shown."""
    await sign_in(page, stack)
    await answered(page, "Say hi.")
    await page.route(REGENERATE, posted_with({"max_tokens": 16}, then_lost=True))
    await page.get_by_role("button", name="Regenerate").click()
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant")).to_have_count(1)
    assert (await replies(page))["text"].strip(), "the reply is not shown"
    await expect(page.locator("#notice")).to_be_hidden()


async def edit_to(page: Page, text: str) -> None:
    await page.get_by_role("button", name="Edit this message").click()
    await page.get_by_label("Edited message").fill(text)
    await page.get_by_role("button", name="Save and rerun").click()


async def test_an_edit_whose_answer_was_lost_shows_its_reply(stack: Stack, page: Page) -> None:
    """Taken as refused: the editor came back while the edit's reply ran unseen, and
    saved again it was refused (a reply runs), then 404 (the message was replaced)."""
    await sign_in(page, stack)
    await answered(page, "What is 2 + 2?")
    await page.route(EDIT, posted_with({"max_tokens": 16}, then_lost=True))
    await edit_to(page, "What is 3 + 3?")
    await replies_over(page, 1)
    await expect(page.locator(".message.user .body")).to_have_text(["What is 3 + 3?"])
    await expect(page.locator(".message.assistant")).to_have_count(1)
    await expect(page.get_by_label("Edited message")).to_have_count(0)
    await expect(page.locator("#notice")).to_be_hidden()


async def test_an_edit_that_never_reached_the_gateway_comes_back_to_its_editor(
    stack: Stack, page: Page
) -> None:
    await sign_in(page, stack)
    await answered(page, "What is 2 + 2?")

    async def dropped(route: Route) -> None:
        await route.abort("connectionreset")

    await page.route(EDIT, dropped)
    await edit_to(page, "What is 3 + 3?")
    await expect(page.locator("#notice")).to_contain_text("not sent")
    await expect(page.get_by_label("Edited message")).to_have_value("What is 3 + 3?")
    await expect(page.locator(".message.user .body")).to_have_text(["What is 2 + 2?"])
    await expect(page.locator(".message.assistant")).to_have_count(1)


async def test_a_message_edited_from_one_editor_at_a_time(stack: Stack, page: Page) -> None:
    """Edit clicked twice opened two editors; the second, left under the first's rerun,
    held the old text and its Save reran again."""
    await sign_in(page, stack)
    await answered(page, "What is 2 + 2?")
    await page.get_by_role("button", name="Edit this message").click()
    await page.get_by_role("button", name="Edit this message").click()
    await expect(page.get_by_label("Edited message")).to_have_count(1)


async def test_an_edit_while_the_gateway_stays_unreachable_keeps_its_text(
    stack: Stack, page: Page
) -> None:
    """Unanswered, then every try to find its reply failed too: the editor had closed on
    the old text, and what was typed was gone."""
    await sign_in(page, stack)
    await answered(page, "What is 2 + 2?")

    async def unreachable(route: Route) -> None:
        await route.abort("connectionreset")

    for path in (EDIT, "**/v1/conversations/*", "**/v1/conversations/*/stream"):
        await page.route(path, unreachable)
    await edit_to(page, "What is 3 + 3?")
    # After the page's resume tries (about 15 s of backing off).
    edited = page.get_by_label("Edited message")
    await expect(edited).to_have_value("What is 3 + 3?", timeout=120_000)
    await expect(page.locator("#notice")).to_be_visible()


async def test_a_regenerate_that_never_reached_the_gateway_says_so(
    stack: Stack, page: Page
) -> None:
    """The reply vanished, then came back from the store word for word, and nothing said
    the regenerate was not sent: it looked as if the model had written it again."""
    await sign_in(page, stack)
    await answered(page, "What is 2 + 2?")
    before = await page.locator(".message.assistant .body").text_content()

    async def dropped(route: Route) -> None:
        await route.abort("connectionreset")

    await page.route(REGENERATE, dropped)
    await page.get_by_role("button", name="Regenerate").click()
    await expect(page.locator("#notice")).to_contain_text("regenerate was not sent")
    await expect(page.locator(".message.assistant .body")).to_have_text([before or ""])
