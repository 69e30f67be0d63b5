"""The chat page in headless Chromium (Debian's, driven by Playwright) against the
whole stack: sign in, watch a reply stream, stop, regenerate, reload and find the
chat in the sidebar. Screenshots go to test-artifacts/screenshots/."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from playwright.async_api import Page, expect

from infra.process import free_port
from infra.roles import GatewayProcess
from tandoor.models import BUNDLED_MODELS
from tests.e2e.browser import ask, replies_over, reply_streaming, shot, sign_in
from tests.e2e.helpers import chat, new_conversation
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration


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

    # Stop mid-answer, from the keyboard: the partial reply stays, marked stopped. While
    # it streams it is busy (a screen reader read the whole reply again at each token);
    # once over, the keyboard is back in the composer (it was on the page's top).
    await ask(page, "Write a very long story about the sea, with many chapters.")
    await reply_streaming(page)
    stopped = page.locator(".message.assistant").last
    await expect(stopped).to_have_attribute("aria-busy", "true")
    await page.get_by_role("button", name="Stop", exact=True).focus()
    await page.keyboard.press("Enter")
    await replies_over(page, 2)
    await expect(stopped.locator(".meta")).to_contain_text("stopped")
    await expect(stopped).not_to_have_attribute("aria-busy", "true")
    await expect(page.get_by_label("Message", exact=True)).to_be_focused()
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
    # Said once, in the page's words: not the gateway's "retry in N s" beside it.
    said = await notice.inner_text()
    assert re.fullmatch(r"Too many requests: [^.]+\. Try again in \d+ seconds?\.", said), said
    assert said.lower().count("again") == 1 and "retry" not in said.lower(), said
    await expect(page.locator(".message.assistant")).to_have_count(0)
    # Not sent: the message leaves the chat and goes back to the composer, not lost.
    await expect(page.locator(".message.user")).to_have_count(0)
    await expect(page.get_by_label("Message", exact=True)).to_have_value("Say hello again.")
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


async def test_numbered_steps_and_links_render_as_written(stack: Stack, page: Page) -> None:
    """A model's "1. ...", a blank line, "2. ..." showed "1. 1. 1." (each item its own
    list); a link to a page named with parentheses stayed raw Markdown, and a "*" in an
    address became <em> inside the href, which then led elsewhere; a link, digits and a
    second link made a link to "undefined"."""
    await page.goto(stack.url)
    steps, wiki, starred, numbered = await page.evaluate(
        """async () => {
          const { renderMarkdown } = await import('/web/markdown.js');
          return [renderMarkdown('1. Heat\\n\\n2. Stir\\nslowly\\n\\n3. Serve'),
                  renderMarkdown('[Foo](https://en.wikipedia.org/wiki/Foo_(bar)) page'),
                  renderMarkdown('[q](https://x.io/a*b*c) and *this*'),
                  renderMarkdown('[a](http://x.io)2[b](http://y.io)')];
        }"""
    )
    assert steps == (
        '<ol><li>Heat</li></ol><ol start="2"><li>Stir</li></ol><p>slowly</p>'
        '<ol start="3"><li>Serve</li></ol>'
    )
    link = '<a href="{}" rel="noopener noreferrer nofollow" target="_blank">{}</a>'
    assert wiki == f"<p>{link.format('https://en.wikipedia.org/wiki/Foo_(bar)', 'Foo')} page</p>"
    assert starred == f"<p>{link.format('https://x.io/a*b*c', 'q')} and <em>this</em></p>"
    assert numbered == f"<p>{link.format('http://x.io', 'a')}2{link.format('http://y.io', 'b')}</p>"


async def test_a_reply_of_brackets_renders_in_linear_time(stack: Stack, page: Page) -> None:
    """From every "[" of a line, the link pattern scanned to the line's end: a reply of
    16,000 "[" took 227 ms a render, at each token, and froze the page for most of a
    minute. 200,000 (42 s a render before) are given a minute, a thousandth of it now.
    The code fence's pattern was quadratic too, in spaces."""
    await page.goto(stack.url)
    rendered = page.evaluate(
        """async () => {
          const { renderMarkdown } = await import('/web/markdown.js');
          const brackets = renderMarkdown('['.repeat(200000));
          const links = renderMarkdown('[a](http://x'.repeat(50000));
          // Spaces between a fence and a language that never comes: 0.7 s at 30,000.
          const fence = renderMarkdown('```' + ' '.repeat(200000) + 'x y');
          return [brackets.length, links.length, renderMarkdown('see [[docs](https://d.io/a)'),
                  fence.length, renderMarkdown('## Title\\r\\n- one\\r\\n- two\\r\\n')];
        }"""
    )
    brackets, links, nested, fence, windows = await asyncio.wait_for(rendered, 60)
    assert brackets == len("<p></p>") + 200_000 and links > 600_000
    assert fence == len("<p></p>") + 200_006
    assert windows == "<h4>Title</h4><ul><li>one</li><li>two</li></ul>", "Windows line ends"
    assert nested == (
        '<p>see [<a href="https://d.io/a" rel="noopener noreferrer nofollow" '
        'target="_blank">docs</a></p>'
    )


async def test_the_model_picker_sends_to_the_model_chosen(stack: Stack, page: Page) -> None:
    await sign_in(page, stack, tier="brief")  # short replies: Gemma is slow on a CPU
    picker = page.get_by_label("Model", exact=True)
    options = "options => options.map(o => [o.value, o.textContent])"
    offered = dict(await picker.locator("option").evaluate_all(options))
    # A display name where the configuration gives one (Gemma's here), else the served name.
    shown = BUNDLED_MODELS["gemma3"]
    assert offered[stack.model] == stack.model and offered[stack.second] == shown, offered
    await picker.select_option(stack.second)
    await ask(page, "Name a colour.")
    await replies_over(page, 1)
    await expect(page.locator(".message.assistant .meta").last).to_contain_text(shown)
    await expect(page.locator("#chat-model")).to_have_text(shown)
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
    await expect(page.locator("#chat-title")).to_have_text("Italian geography")
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
