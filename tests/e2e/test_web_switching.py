"""The chat page while a reply runs, in headless Chromium against the whole stack: the
reader moves to another chat (the reply runs on there, and the composer, Stop and
Escape belong to the chat on screen), edits a message twice, closes an editor with
Escape; and a very long word stays inside its bubble."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from tests.e2e.browser import (
    ask,
    replies_over,
    reply_streaming,
    shot,
    sign_in,
    stop_if_running,
)
from tests.e2e.helpers import chat, new_conversation, stored_reply
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration

LONG = "Write a very long story about the sea, with many chapters."


async def count_requests(page: Page, ending: str, into: str) -> None:
    """From now on the page notes each request to a URL ending with `ending`, as it sends
    it, in window[into]."""
    await page.evaluate(
        """([ending, into]) => {
          window[into] = [];
          const send = window.fetch;
          window.fetch = (url, init) => {
            if (String(url).endsWith(ending)) window[into].push(String(url));
            return send(url, init);
          };
        }""",
        [ending, into],
    )


async def count_stops(page: Page) -> None:
    """From now on the page notes each Stop it sends (window.stops)."""
    await count_requests(page, "/stop", "stops")


async def stops(page: Page) -> list[str]:
    return list(await page.evaluate("window.stops"))


async def messages_of(stack: Stack, headers: dict[str, str], conversation: str) -> Any:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        response = await http.get(f"/v1/conversations/{conversation}", headers=headers)
        assert response.status_code == 200, response.text
        return response.json()["messages"]


async def test_another_chat_opened_mid_reply_is_the_one_the_page_serves(
    stack: Stack, page: Page
) -> None:
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        other = await new_conversation(http, headers)
        await chat(http, headers, other, "Say hi.", 4)
    await count_stops(page)
    await ask(page, LONG)
    await reply_streaming(page)
    running = await page.locator('#conversation-list button[aria-current="true"]').get_attribute(
        "data-id"
    )
    assert running and running != other

    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
    # Not busy with the other chat's reply: Send is back, and Escape stops nothing.
    await expect(page.get_by_role("button", name="Send", exact=True)).to_be_visible()
    await expect(page.locator(".message.assistant.streaming")).to_have_count(0)
    await page.keyboard.press("Escape")
    assert await stops(page) == [], "Escape in this chat stopped the other chat's reply"
    await ask(page, "Say bye.")
    await replies_over(page, 2)
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi.", "Say bye."])
    await shot(page, "16-other-chat-mid-reply")

    # Back: the reply ran on, and is followed again (or shown stored, if it ended).
    await page.locator(f'#conversation-list button[data-id="{running}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text([LONG])
    await expect(page.locator(".message.assistant .body")).not_to_be_empty()
    await stop_if_running(page)
    await replies_over(page, 1)
    assert set(await stops(page)) <= {f"/v1/conversations/{running}/stop"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        # Stored a moment after the page has its end: persistence writes it.
        stored = await stored_reply(http, headers, running)
    replies = [m for m in stored if m["role"] == "assistant"]
    assert len(replies) == 1 and replies[0]["content"], replies


async def test_a_message_edited_twice_and_an_editor_closed_with_escape(
    stack: Stack, page: Page
) -> None:
    headers = await sign_in(page, stack)
    await ask(page, "What is 2 + 2?")
    await replies_over(page, 1)
    for question in ("What is 3 + 3?", "What is 4 + 4?"):  # the second edit was a 404
        await page.get_by_role("button", name="Edit this message").click()
        await page.get_by_label("Edited message").fill(question)
        await page.get_by_role("button", name="Save and rerun").click()
        await replies_over(page, 1)
        await expect(page.locator(".message.user .body")).to_have_text([question])
        await expect(page.get_by_role("alert")).to_be_hidden()
    conversation = await page.locator(
        '#conversation-list button[aria-current="true"]'
    ).get_attribute("data-id")
    assert conversation
    shown = [
        m for m in await messages_of(stack, headers, conversation) if m["status"] != "replaced"
    ]
    assert [m["content"] for m in shown if m["role"] == "user"] == ["What is 4 + 4?"]

    # An editor open while a reply starts: Escape closes it, and stops nothing.
    await count_stops(page)
    await page.get_by_role("button", name="Edit this message").click()
    await page.get_by_label("Message", exact=True).fill(LONG)
    await page.get_by_label("Message", exact=True).press("Enter")
    await expect(page.locator("button.edit:visible")).to_have_count(0)  # none while it runs
    await page.get_by_label("Edited message").press("Escape")
    await expect(page.get_by_label("Edited message")).to_have_count(0)
    assert await stops(page) == [], "Escape in the editor stopped the reply too"
    await stop_if_running(page)
    await replies_over(page, 2)
    await expect(page.locator("button.edit:visible")).to_have_count(2)


async def test_a_very_long_word_stays_inside_its_bubble(stack: Stack, page: Page) -> None:
    await sign_in(page, stack)
    overflow = await page.evaluate(
        """async () => {
          const { renderMarkdown } = await import('/web/markdown.js');
          const item = document.createElement('li');
          item.className = 'message assistant';
          const body = document.createElement('div');
          body.className = 'body';
          const link = 'https://x.io/' + 'b'.repeat(3000);
          body.innerHTML = renderMarkdown('a'.repeat(5000) + ' ' + link);
          item.append(body);
          const list = document.getElementById('messages');
          list.append(item);
          return [body.scrollWidth - body.clientWidth, list.scrollWidth - list.clientWidth];
        }"""
    )
    assert overflow == [0, 0], "the word ran out of its bubble, and the list scrolled sideways"


async def test_a_chat_deleted_in_another_tab_is_left_for_a_new_one(
    stack: Stack, page: Page
) -> None:
    """It stayed open, and every message sent to it was a 404 with its text put back,
    until the user thought of "New chat"."""
    headers = await sign_in(page, stack, tier="brief")
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    opened = page.locator('#conversation-list button[aria-current="true"]')
    conversation = await opened.get_attribute("data-id")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:  # the other tab
        deleted = await http.delete(f"/v1/conversations/{conversation}", headers=headers)
        assert deleted.status_code == 204, deleted.text
    await ask(page, "Say bye.")
    await expect(page.locator("#notice")).to_contain_text("not found")
    await expect(page.locator(".message")).to_have_count(0)  # a new chat's empty page
    await expect(page.get_by_label("Message", exact=True)).to_have_value("Say bye.")
    await page.get_by_role("button", name="Send", exact=True).click()  # sent again: to a new chat
    await replies_over(page, 1)
    await expect(page.locator(".message.user .body")).to_have_text(["Say bye."])
    await expect(page.locator("#conversation-list button")).to_have_count(1)


async def test_a_chat_clicked_twice_mid_reply_follows_its_reply_once(
    stack: Stack, page: Page
) -> None:
    """Clicked again while it loaded, the chat started a second reader of its reply: the
    reply showed twice, and the first reader's end brought Send back while it ran."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        other = await new_conversation(http, headers)
        await chat(http, headers, other, "Say hi.", 4)
    await ask(page, LONG)
    await reply_streaming(page)
    running = await page.locator('#conversation-list button[aria-current="true"]').get_attribute(
        "data-id"
    )
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi."])
    await count_requests(page, "/stream", "reads")
    await page.evaluate(
        """(id) => {
          const chat = document.querySelector(`#conversation-list button[data-id="${id}"]`);
          chat.click();
          chat.click();
        }""",
        running,
    )
    await expect(page.locator(".message.user .body")).to_have_text([LONG])
    await expect(page.locator(".message.assistant.streaming .body")).not_to_be_empty()
    assert await page.evaluate("window.reads") == [f"/v1/conversations/{running}/stream"]
    await expect(page.locator(".message.assistant")).to_have_count(1)
    await stop_if_running(page)
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant")).to_have_count(1)
