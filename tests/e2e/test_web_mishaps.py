"""The chat page when something goes wrong around the reader, in headless Chromium
against the whole stack: a chat clicked that fails to open, or that another tab
deleted (clicked, or sent to while it loads); Stop pressed as the reply ends, or
answered "none running" while it runs on; a new chat's header while its first reply
runs; and the page for readers on a phone, with a screen reader or a keyboard."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from tandoor.clients import redis_client
from tandoor.policies.redis_keys import inflight_key
from tests.e2e.browser import (
    ask,
    held_until_set,
    replies,
    replies_over,
    reply_streaming,
    sent_while_it_loads,
    sign_in,
    stop_if_running,
)
from tests.e2e.helpers import chat, new_conversation
from tests.e2e.stack import Stack
from tests.e2e.test_web_rerun import REGENERATE, posted_with
from tests.e2e.test_web_switching import LONG, messages_of
from tests.waiting import eventually

pytestmark = pytest.mark.integration

# Every text the notice shows, as it shows it (one shown, then hidden, is still seen).
WATCH_NOTICES = """() => {
  window.notices = [];
  const notice = document.getElementById('notice');
  new MutationObserver(() => { if (!notice.hidden) window.notices.push(notice.textContent); })
    .observe(notice, { attributes: true, childList: true, characterData: true, subtree: true });
}"""


async def two_chats(stack: Stack, headers: dict[str, str], page: Page) -> tuple[str, str]:
    """Two chats with one answered question each; the page shows the first."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        shown, other = await new_conversation(http, headers), await new_conversation(http, headers)
        await chat(http, headers, shown, "Say hi.", 4)
        await chat(http, headers, other, "Name a colour.", 4)
    await page.reload()
    await page.locator(f'#conversation-list button[data-id="{shown}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
    return shown, other


async def questions(stack: Stack, headers: dict[str, str], conversation: str) -> list[str]:
    stored = await messages_of(stack, headers, conversation)
    return [m["content"] for m in stored if m["role"] == "user"]


async def test_a_chat_that_fails_to_open_leaves_the_next_message_to_the_chat_shown(
    stack: Stack, page: Page
) -> None:
    """The chat clicked stayed the one chosen: the follow-up typed under the chat on
    screen went to the chat that had failed to open."""
    headers = await sign_in(page, stack, tier="brief")
    shown, other = await two_chats(stack, headers, page)

    async def unreachable(route: Route) -> None:
        await (route.abort() if route.request.method == "GET" else route.continue_())

    await page.route(f"**/v1/conversations/{other}", unreachable)
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator("#notice")).to_contain_text("cannot be reached")
    await ask(page, "Say bye.")
    await replies_over(page, 2)
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi.", "Say bye."])
    assert await questions(stack, headers, shown) == ["Say hi.", "Say bye."]
    assert await questions(stack, headers, other) == ["Name a colour."]


async def test_a_chat_deleted_elsewhere_and_clicked_leaves_the_chat_shown_open(
    stack: Stack, page: Page
) -> None:
    """The 404 for the chat clicked closed the chat being read (and cut its reply)."""
    headers = await sign_in(page, stack, tier="brief")
    _, other = await two_chats(stack, headers, page)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:  # the other tab
        deleted = await http.delete(f"/v1/conversations/{other}", headers=headers)
        assert deleted.status_code == 204, deleted.text
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator("#notice")).to_contain_text("not found")
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
    await expect(page.locator("#conversation-list button")).to_have_count(1)  # it left the list


async def test_a_message_sent_to_a_chat_deleted_meanwhile_leaves_the_chat_shown_open(
    stack: Stack, page: Page
) -> None:
    """Sent while the chat clicked still loaded, the message waited for it: that chat's
    404 closed the chat being read."""
    headers = await sign_in(page, stack, tier="brief")
    _, other = await two_chats(stack, headers, page)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:  # the other tab
        deleted = await http.delete(f"/v1/conversations/{other}", headers=headers)
        assert deleted.status_code == 204, deleted.text
    let_go = await held_until_set(page, f"**/v1/conversations/{other}")
    await sent_while_it_loads(page, other, "Say bye.", let_go)
    await expect(page.locator("#notice")).to_contain_text("not found")
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
    composer = page.get_by_label("Message", exact=True)
    await expect(composer).to_have_value("Say bye.")  # not sent: waiting to be


async def test_stop_pressed_as_the_reply_ends_says_nothing_went_wrong(
    stack: Stack, page: Page
) -> None:
    """Its stop reached the gateway after the reply had ended: "no reply is being
    generated" showed under a reply that had stopped."""
    headers = await sign_in(page, stack)
    await page.evaluate(WATCH_NOTICES)
    let_go = await held_until_set(page, "**/stop")
    await ask(page, LONG)
    await reply_streaming(page)
    conversation = await page.locator(
        '#conversation-list button[aria-current="true"]'
    ).get_attribute("data-id")
    await page.get_by_role("button", name="Stop", exact=True).click()  # held on its way
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:  # another tab's
        stopped = await http.post(f"/v1/conversations/{conversation}/stop", headers=headers)
        assert stopped.status_code == 202, stopped.text
    await replies_over(page, 1)
    async with page.expect_response("**/stop") as answered:
        let_go.set()
    assert (await answered.value).status == 409  # the gateway's word: none running
    await ask(page, "Say bye.")  # the page has long handled that answer by its end
    await replies_over(page, 2)
    assert await page.evaluate("window.notices") == []


async def test_stop_answered_none_running_while_the_reply_runs_on_says_so(
    stack: Stack, page: Page
) -> None:
    """The reply's record lost (Redis restarted empty, a few seconds before its gateway
    writes it back): the stop's 409 is said, not taken for the reply's end; pressed
    again, it stops the reply."""
    await sign_in(page, stack)
    await ask(page, LONG)
    await reply_streaming(page)
    conversation = await page.locator(
        '#conversation-list button[aria-current="true"]'
    ).get_attribute("data-id")
    assert conversation
    redis = redis_client(stack.settings)
    try:
        await redis.delete(inflight_key(conversation))
    finally:
        await redis.aclose()
    await page.get_by_role("button", name="Stop", exact=True).click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("no reply is being generated", timeout=30_000)

    async def stopping() -> dict[str, Any]:
        await stop_if_running(page)
        return await replies(page)

    await eventually(stopping, lambda shown: not shown["streaming"], what="the reply stopped")
    await expect(page.locator(".message.assistant .meta")).to_contain_text("stopped")


async def test_a_new_chats_header_keeps_its_opening_words_while_its_first_reply_runs(
    stack: Stack, page: Page
) -> None:
    """The sidebar, read before the message (and the title it gives) was stored, put
    "New chat" back in the header for the whole first reply."""
    await sign_in(page, stack)
    await ask(page, LONG)
    await reply_streaming(page)
    await expect(page.locator('#conversation-list button[aria-current="true"]')).to_have_count(1)
    await expect(page.locator("#chat-title")).to_have_text(LONG)
    await page.get_by_role("button", name="Stop", exact=True).click()
    await replies_over(page, 1)


async def test_a_phone_wide_page_leaves_room_to_write(stack: Stack, page: Page) -> None:
    """The sidebar kept its 17em beside the chat: on a phone (or at 400% zoom) the
    message box was left a few dozen pixels wide, and the header ran off the page."""
    await page.set_viewport_size({"width": 360, "height": 740})
    await sign_in(page, stack, tier="brief")
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    box = await page.get_by_label("Message", exact=True).bounding_box()
    assert box is not None and box["width"] >= 250, box
    for name in ("Send", "Regenerate", "Rename", "Delete"):
        await expect(page.get_by_role("button", name=name)).to_be_in_viewport()
    sideways = await page.evaluate(
        "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert sideways == 0, "the page scrolls sideways"


async def test_a_reply_is_read_out_once_it_ends_and_an_opened_chat_is_not(
    stack: Stack, page: Page
) -> None:
    """The message list was a live region: a screen reader read the whole chat out each
    time one was opened (and again at each of the page's reloads of it)."""
    headers = await sign_in(page, stack, tier="brief")
    _, other = await two_chats(stack, headers, page)
    assert await page.locator("[aria-live] .message").count() == 0
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Name a colour."])
    await expect(page.locator("#announcer")).to_have_text("")  # nothing read out
    await ask(page, "Say bye.")
    await replies_over(page, 2)
    last = page.locator(".message.assistant .body").last
    await expect(page.locator("#announcer")).to_contain_text(await last.inner_text())
    await expect(page.locator("#announcer")).not_to_have_text("")


async def test_the_keyboard_focus_stays_where_the_reader_is(stack: Stack, page: Page) -> None:
    """Regenerate and Delete hide as they are pressed, and the sidebar is rebuilt as a
    reply ends: each time the focus fell to the page's top, the next Tab starting over."""
    headers = await sign_in(page, stack)
    _, other = await two_chats(stack, headers, page)
    await page.route(REGENERATE, posted_with({"max_tokens": 150, "ignore_eos": True}))
    await page.get_by_role("button", name="Regenerate").focus()
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_focused()
    listed = page.locator(f'#conversation-list button[data-id="{other}"]')
    await listed.focus()  # moving through the chats while the reply runs
    await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_visible()
    await replies_over(page, 1)  # its end rebuilt the list
    await expect(listed).to_be_focused()
    page.once("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await page.get_by_role("button", name="Delete").focus()
    await page.keyboard.press("Enter")
    await expect(page.get_by_label("Message", exact=True)).to_be_focused()


async def test_an_edit_refused_while_another_tabs_reply_runs_shows_it_and_keeps_the_edit(
    stack: Stack, page: Page
) -> None:
    """A 409 "stop it first" with no Stop to press and the reply nowhere in sight, where
    a message or a regenerate refused so shows the running reply."""
    headers = await sign_in(page, stack, tier="brief")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        conversation = await new_conversation(http, headers, stack.second)
        await chat(http, headers, conversation, "Say hi.", 4)
        await page.reload()
        await page.locator(f'#conversation-list button[data-id="{conversation}"]').click()
        await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
        worker = stack.second_worker
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGSTOP)  # the other tab's reply runs on meanwhile
        try:
            path = f"/v1/conversations/{conversation}/messages"
            body = {"content": "Name a colour.", "max_tokens": 8}
            async with http.stream("POST", path, json=body, headers=headers) as other_tab:
                assert other_tab.status_code == 200  # its start event came: the tab closes
            await page.get_by_role("button", name="Edit this message").first.click()
            await page.get_by_label("Edited message").fill("Say hello.")
            await page.get_by_role("button", name="Save and rerun").click()
            await expect(page.locator("#notice")).to_contain_text("being generated")
            await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_visible()
            await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
            await expect(page.get_by_label("Edited message")).to_have_value("Say hello.")
        finally:
            worker.proc.send_signal(signal.SIGCONT)
    await replies_over(page, 2)
    await page.get_by_role("button", name="Save and rerun").click()  # once it has ended
    await replies_over(page, 1)
    await expect(page.locator(".message.user .body")).to_have_text(["Say hello."])


async def test_a_chat_opened_while_the_deleted_one_goes_stays_open(
    stack: Stack, page: Page
) -> None:
    """The delete answered after another chat was opened (it first stops the deleted
    chat's reply, through Kafka): the page then closed the chat opened meanwhile."""
    headers = await sign_in(page, stack, tier="brief")
    shown, other = await two_chats(stack, headers, page)
    let_go = await held_until_set(page, f"**/v1/conversations/{shown}")
    page.once("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await page.get_by_role("button", name="Delete").click()
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Name a colour."])
    let_go.set()
    await expect(page.locator("#conversation-list button")).to_have_count(1)  # deleted
    await expect(page.locator(".message.user .body")).to_have_text(["Name a colour."])
    await expect(page.locator("#chat-title")).not_to_have_text("New chat")
