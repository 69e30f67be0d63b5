"""The chat page against quick hands, in headless Chromium against the whole stack: an
input method's Enter and Escape, a chat chosen while an earlier choice is still
loading, "Load more" clicked twice (and its chats kept when a reply ends), Stop
pressed before the reply starts, an edit of pasted code, refused, a chat clicked
while a message is being sent, and the streaming chat clicked again while another loads."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from tests.e2e.browser import (
    ask,
    held_until_set,
    replies,
    replies_over,
    reply_streaming,
    sent_while_it_loads,
    sign_in,
)
from tests.e2e.helpers import chat, new_conversation, stored_reply
from tests.e2e.stack import Stack
from tests.e2e.test_web_switching import LONG, count_stops, stops
from tests.waiting import eventually

pytestmark = pytest.mark.integration

# A keydown as an input method sends it while composing (Chrome and Firefox say so with
# isComposing, Safari with keyCode 229), dispatched and read back in one step: the
# page's handlers run inside dispatchEvent.
COMPOSING_KEY = """([key, legacy]) => {
  const init = { key, bubbles: true, cancelable: true };
  const how = legacy ? { keyCode: 229 } : { isComposing: true };
  const event = new KeyboardEvent('keydown', { ...init, ...how });
  document.getElementById('prompt').dispatchEvent(event);
  return { prompt: document.getElementById('prompt').value, stops: (window.stops || []).length };
}"""


@pytest.mark.parametrize("legacy", [False, True], ids=["isComposing", "keyCode-229"])
async def test_an_input_methods_enter_and_escape_neither_send_nor_stop(
    stack: Stack, page: Page, legacy: bool
) -> None:
    """Committing a Japanese conversion with Enter sent the half-typed text; cancelling
    one with Escape stopped the reply."""
    await sign_in(page, stack)
    await page.get_by_label("Message", exact=True).fill("こんにちは")
    after = await page.evaluate(COMPOSING_KEY, ["Enter", legacy])
    assert after["prompt"] == "こんにちは", "the composition's Enter sent the message"
    await page.get_by_label("Message", exact=True).fill("")
    await ask(page, LONG)
    await reply_streaming(page)
    await count_stops(page)
    after = await page.evaluate(COMPOSING_KEY, ["Escape", legacy])
    assert after["stops"] == 0 and await stops(page) == []
    await page.get_by_role("button", name="Stop", exact=True).click()
    await replies_over(page, 1)


async def test_the_chat_chosen_last_is_shown_whatever_answers_last(
    stack: Stack, page: Page
) -> None:
    """B chosen, then C: B's slower answer was shown over C, and the composer sent
    to B."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        slow, chosen = [await new_conversation(http, headers) for _ in range(2)]
        await chat(http, headers, slow, "Say hi.", 4)
        await chat(http, headers, chosen, "Say bye.", 4)
    await page.reload()  # signed in again from the session: the new chats listed
    await expect(page.locator("#app")).to_be_visible()
    let_go = await held_until_set(page, f"**/v1/conversations/{slow}")
    async with page.expect_response(f"**/v1/conversations/{slow}") as answered:
        await page.locator(f'#conversation-list button[data-id="{slow}"]').click()
        await page.locator(f'#conversation-list button[data-id="{chosen}"]').click()
        await expect(page.locator(".message.user .body")).to_have_text(["Say bye."])
        let_go.set()
    await (await answered.value).finished()
    await page.wait_for_load_state("networkidle")  # the page has read the late answer
    await expect(page.locator(".message.user .body")).to_have_text(["Say bye."])
    current = page.locator('#conversation-list button[aria-current="true"]')
    await expect(current).to_have_attribute("data-id", chosen)


async def test_load_more_clicked_twice_lists_each_chat_once(stack: Stack, page: Page) -> None:
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        made = {await new_conversation(http, headers) for _ in range(35)}
    await page.reload()  # signed in again from the session: the new chats listed
    await expect(page.locator("#app")).to_be_visible()
    await expect(page.locator("#more-conversations")).to_be_visible()
    await page.locator("#more-conversations").dblclick()
    listed = page.locator("#conversation-list button")
    await expect(listed).to_have_count(35)
    await page.wait_for_load_state("networkidle")  # a second page, had one been asked for
    ids = [str(await b.get_attribute("data-id")) for b in await listed.all()]
    assert sorted(ids) == sorted(made), "a chat listed twice, or one missing"


async def test_the_chats_load_more_listed_stay_listed_after_a_reply(
    stack: Stack, page: Page
) -> None:
    """The sidebar is read again when a reply ends (a new chat's title, the order): it
    went back to its first page, dropping the chats "Load more" had listed."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        made = [await new_conversation(http, headers) for _ in range(35)]
    await page.reload()
    await expect(page.locator("#app")).to_be_visible()
    await page.locator("#more-conversations").click()
    listed = page.locator("#conversation-list button")
    await expect(listed).to_have_count(35)
    await page.locator(f'#conversation-list button[data-id="{made[0]}"]').click()  # the oldest
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    await page.wait_for_load_state("networkidle")  # the list read again at the reply's end
    await expect(listed).to_have_count(35)
    await expect(page.locator("#more-conversations")).to_be_hidden()
    ids = [str(await b.get_attribute("data-id")) for b in await listed.all()]
    assert sorted(ids) == sorted(made), "a chat listed twice, or one missing"


@pytest.mark.parametrize(
    ("new_chat", "escape"),
    [(False, False), (True, False), (True, True)],
    ids=["open-chat", "new-chat", "new-chat-escape"],
)
async def test_a_stop_pressed_before_the_reply_starts_stops_it(
    stack: Stack, page: Page, new_chat: bool, escape: bool
) -> None:
    """Stop is shown as the message is sent, but the gateway answers 409 until it has
    the reply: "no reply is being generated", and the reply ran to its end (in a new
    chat, a TypeError: no chat id yet; Escape there did nothing at all)."""
    headers = await sign_in(page, stack)
    if not new_chat:
        await ask(page, "Say hi.")
        await replies_over(page, 1)
    held = "**/v1/conversations" if new_chat else "**/v1/conversations/*/messages"

    stop_pressed = asyncio.Event()

    async def until_stop(route: Route) -> None:
        if route.request.method == "POST":
            await stop_pressed.wait()  # the request in flight while Stop is pressed
        await route.continue_()

    await page.route(held, until_stop)
    await ask(page, LONG)
    if escape:
        await page.keyboard.press("Escape")
    else:
        await page.get_by_role("button", name="Stop", exact=True).click()
    stop_pressed.set()
    await replies_over(page, 1 if new_chat else 2)
    await expect(page.locator("#notice")).to_be_hidden()
    await expect(page.locator(".message.assistant .meta").last).to_contain_text("stopped")
    conversation = await page.locator(
        '#conversation-list button[aria-current="true"]'
    ).get_attribute("data-id")
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:

        async def last_status() -> str:
            path = f"/v1/conversations/{conversation}"
            return str((await http.get(path, headers=headers)).json()["messages"][-1]["status"])

        stored = await eventually(last_status, lambda s: s != "sent", what="the reply stored")
    assert stored == "stopped"


async def test_an_edit_starts_from_the_text_as_sent_and_a_refused_one_is_kept(
    stack: Stack, page: Page
) -> None:
    """Edit started from the text as shown, its indentation collapsed: fixing a typo
    sent pasted code flattened. A refused edit (a reply running in another tab, 429)
    threw the edited text away."""
    await sign_in(page, stack)
    code = "def f():\n    return 1"
    await ask(page, code)
    await replies_over(page, 1)
    await page.get_by_role("button", name="Edit this message").click()
    await expect(page.get_by_label("Edited message")).to_have_value(code)

    async def too_many(route: Route) -> None:
        error = {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}
        await route.fulfill(status=429, json={"error": error}, headers={"Retry-After": "1"})

    await page.route("**/messages/*/edit", too_many)
    await page.get_by_label("Edited message").fill("def g():\n    return 2")
    await page.get_by_role("button", name="Save and rerun").click()
    await expect(page.get_by_role("alert").first).to_contain_text("slow down")
    await expect(page.get_by_label("Edited message")).to_have_value("def g():\n    return 2")


async def test_regenerate_in_a_tab_behind_another_answers_nothing_it_does_not_show(
    stack: Stack, page: Page
) -> None:
    """Q1 and its reply on screen, Q2 sent from another tab: Regenerate replaced Q2's
    reply with a new answer to Q2, shown under Q1."""
    headers = await sign_in(page, stack)
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    conversation = str(
        await page.locator('#conversation-list button[aria-current="true"]').get_attribute(
            "data-id"
        )
    )
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        await chat(http, headers, conversation, "Say bye.", 4)  # the other tab
        shown_before = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
        path = f"/v1/conversations/{conversation}/regenerate"
        stale = await http.post(path, json={"reply_to": "m_not_the_last"}, headers=headers)
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "reply_to"
    await page.get_by_role("button", name="Regenerate").click()
    await expect(page.get_by_role("alert").first).to_contain_text("newer message")
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi.", "Say bye."])
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        shown_after = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
    assert shown_after["messages"] == shown_before["messages"], "a reply was replaced"


async def test_the_open_chat_clicked_while_its_message_is_sent_keeps_it(
    stack: Stack, page: Page
) -> None:
    """It was opened again from the store, which did not hold the message yet: the
    question vanished, and its reply streamed where nobody could see it."""
    await sign_in(page, stack)
    await ask(page, "Say hi.")
    await replies_over(page, 1)
    let_go = asyncio.Event()

    async def held(route: Route) -> None:
        if route.request.method == "POST":
            await let_go.wait()
        await route.continue_()

    await page.route("**/v1/conversations/*/messages", held)
    await ask(page, "Say bye.")
    await page.locator('#conversation-list button[aria-current="true"]').click()
    let_go.set()
    await replies_over(page, 2)
    await expect(page.locator(".message.user .body")).to_have_text(["Say hi.", "Say bye."])
    texts = await page.locator(".message.assistant .body").all_text_contents()
    assert len(texts) == 2 and all(t.strip() for t in texts), texts  # each shown, once


async def test_a_new_chats_message_goes_to_that_chat_whatever_is_clicked_meanwhile(
    stack: Stack, page: Page
) -> None:
    """The message's path was read after the sidebar had been read again: a chat
    clicked meanwhile got the message, and the new chat was left empty."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        other = await new_conversation(http, headers)
    await page.reload()
    await expect(page.locator("#app")).to_be_visible()
    await page.get_by_label("Model", exact=True).select_option(stack.model)
    let_go = asyncio.Event()

    async def sidebar_held(route: Route) -> None:
        await let_go.wait()
        await route.continue_()

    await page.route("**/v1/conversations?*", sidebar_held)
    posted: list[str] = []
    page.on(
        "request",
        lambda r: (
            posted.append(r.url) if r.method == "POST" and r.url.endswith("/messages") else None
        ),
    )
    async with page.expect_response("**/v1/conversations") as created_response:
        await ask(page, "Say hi.")
    created = (await (await created_response.value).json())["id"]
    await page.locator(f'#conversation-list button[data-id="{other}"]').click()
    let_go.set()
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:

        async def stored(conversation: str) -> list[str]:
            response = await http.get(f"/v1/conversations/{conversation}", headers=headers)
            return [m["content"] for m in response.json()["messages"] if m["role"] == "user"]

        await eventually(lambda: stored(created), lambda found: found == ["Say hi."], what="sent")
        assert await stored(other) == []
    assert posted and all(created in url for url in posted), posted


async def test_the_streaming_chat_clicked_again_before_another_loads_stays_shown(
    stack: Stack, page: Page
) -> None:
    """A streams; B clicked, then A again while B loads: the click on A, the chat open,
    was passed over, and B's late answer replaced A and its stream."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        other = await new_conversation(http, headers)
        await chat(http, headers, other, "Say bye.", 4)
    await page.reload()  # signed in again from the session: the chat listed
    await expect(page.locator("#app")).to_be_visible()
    await ask(page, LONG)
    await reply_streaming(page)
    current = page.locator('#conversation-list button[aria-current="true"]')
    streaming = await current.get_attribute("data-id")
    let_go = await held_until_set(page, f"**/v1/conversations/{other}")
    async with page.expect_response(f"**/v1/conversations/{other}") as answered:
        await page.locator(f'#conversation-list button[data-id="{other}"]').click()
        await page.locator(f'#conversation-list button[data-id="{streaming}"]').click()
        let_go.set()
    await (await answered.value).finished()
    seen = len((await replies(page))["streamed"])
    await eventually(
        lambda: replies(page),
        lambda shown: len(shown["streamed"]) > seen + 20,
        what="the reply of the chat clicked last streaming on",
    )
    await expect(page.locator(".message.user .body")).to_have_text([LONG])
    await expect(current).to_have_attribute("data-id", str(streaming))
    await page.get_by_role("button", name="Stop", exact=True).click()


async def test_a_message_refused_while_another_tabs_reply_runs_shows_that_reply_and_stop(
    stack: Stack, page: Page
) -> None:
    """The other tab's reply ran in this chat: sending here was a 409 "stop it first",
    with no Stop to press and the reply nowhere in sight."""
    headers = await sign_in(page, stack, tier="brief")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        conversation = await new_conversation(http, headers, stack.second)
        await page.reload()
        await page.locator(f'#conversation-list button[data-id="{conversation}"]').click()
        worker = stack.second_worker
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGSTOP)  # the other tab's reply runs on meanwhile
        try:
            path = f"/v1/conversations/{conversation}/messages"
            body = {"content": "Name a colour.", "max_tokens": 8}
            async with http.stream("POST", path, json=body, headers=headers) as other_tab:
                assert other_tab.status_code == 200  # its start event came: the tab closes
            await ask(page, "Name a fruit.")
            await expect(page.locator("#notice")).to_contain_text("being generated")
            await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_visible()
            await expect(page.locator(".message.assistant.streaming")).to_have_count(1)
        finally:
            worker.proc.send_signal(signal.SIGCONT)
    await replies_over(page, 1)
    await expect(page.locator(".message.user .body")).to_have_text(["Name a colour."])
    await expect(page.get_by_label("Message", exact=True)).to_have_value("Name a fruit.")


async def test_a_message_sent_while_the_chat_clicked_loads_goes_to_that_chat(
    stack: Stack, page: Page
) -> None:
    """Sent before the chat clicked had loaded (no chat open yet), it started a new chat
    instead."""
    headers = await sign_in(page, stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        chosen = await new_conversation(http, headers)
    await page.reload()
    await expect(page.locator("#app")).to_be_visible()
    let_go = await held_until_set(page, f"**/v1/conversations/{chosen}")
    await sent_while_it_loads(page, chosen, "Say hi.", let_go)
    await replies_over(page, 1)
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
        stored = await stored_reply(http, headers, chosen)
    assert [c["id"] for c in listed] == [chosen], "a new chat took the message"
    assert [m["content"] for m in stored if m["role"] == "user"] == ["Say hi."]
