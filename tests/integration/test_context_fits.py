"""The context the gateway builds, rendered as the worker renders it (each bundled
model's real tokenizer and chat template; no engine needed): it fits the model's
window with the reply's room, and history that fits is kept.

Counted with OpenAI's cl100k, a Korean or Thai chat took SmolLM2 1.6-2 times the
tokens the gateway thought: once its history filled the budget, the worker refused
every turn ("prompt has 2275 tokens"), and the chat could only be abandoned. Gemma
needs a third to a half of cl100k's count for Hindi or Korean: a message that fits
was a 413, and history that fits was dropped (and summarized away)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.errors import ApiError
from schemas.events import ChatMessage
from tandoor.policies.moderation import DefaultModerator
from tandoor.settings import Settings
from workers.engine import Engine
from workers.model_store import resolve_model_dir

pytestmark = pytest.mark.integration

TEXTS = {
    "korean": "안녕하세요 오늘 날씨가 정말 좋네요. 공원에 산책하러 갈까요? ",
    "thai": "สวัสดีครับ วันนี้อากาศดีมาก ไปเดินเล่นที่สวนกันไหม ",
    "hindi": "नमस्ते, आज मौसम बहुत अच्छा है। चलो पार्क में टहलने चलते हैं। ",
    "newlines": "ok" + "\n" * 60,
}
REPLY_TOKENS = 256


async def renderer(settings: Settings, model: str, template: str | None = None) -> Engine:
    from transformers import AutoTokenizer

    folder = await asyncio.to_thread(resolve_model_dir, model, settings)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
    return Engine(cast(Any, None), tokenizer, settings.models[model].max_model_len, template)


def chat(text: str, turns: int, repeat: int) -> list[ChatMessage]:
    question = ChatMessage(role="user", content=text * repeat)
    answer = ChatMessage(role="assistant", content=text * repeat)
    return [question, answer] * turns + [question]


def checks(settings: Settings) -> ReplyChecks:
    return ReplyChecks(settings, DefaultModerator(), cast(Any, None))


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("language", list(TEXTS))
async def test_a_long_chat_is_cut_to_what_the_model_takes(
    settings: Settings, model: str, language: str
) -> None:
    engine = await renderer(settings, model)
    window = settings.models[model].max_model_len
    asked = chat(TEXTS[language], turns=40, repeat=3)
    context = checks(settings).context(model, asked, REPLY_TOKENS, client_context=False)
    prompt = engine.render_prompt(context.messages)
    assert len(prompt) + REPLY_TOKENS <= window, (len(prompt), context.dropped)
    assert context.messages[-1] == asked[-1]
    if context.dropped:  # not cut further than it must be: a quarter of it not left unused
        kept_one_more = context.messages[:1] + asked[-len(context.messages) :]
        fuller = len(engine.render_prompt(kept_one_more))
        assert fuller + REPLY_TOKENS > window * 0.75, (len(prompt), fuller, window)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
async def test_a_message_is_refused_only_when_the_model_cannot_take_it(
    settings: Settings, model: str
) -> None:
    engine = await renderer(settings, model)
    window = settings.models[model].max_model_len
    for language, text in TEXTS.items():
        for repeat in (5, 10, 20, 40, 80):
            message = [ChatMessage(role="user", content=text * repeat)]
            real = len(engine.render_prompt(message))
            try:
                context = checks(settings).context(model, message, REPLY_TOKENS, False)
            except ApiError as exc:
                assert exc.status == 413, exc
                assert real + REPLY_TOKENS > window * 0.75, (language, repeat, real)
            else:
                assert len(engine.render_prompt(context.messages)) + REPLY_TOKENS <= window


async def test_a_summary_gives_way_to_a_message_that_fits(settings: Settings) -> None:
    """The summary of earlier turns sat in the system prompt, which is never cut: with
    it, a message that fits without it was a 413."""
    message = [ChatMessage(role="user", content="word " * 800)]
    context = checks(settings).context(
        "smollm2", message, REPLY_TOKENS, client_context=False, summary="word " * 1000
    )
    assert [m.content for m in context.messages] == [settings.system_prompt, "word " * 800]
    assert not context.summarized  # the start event says so
    with_room = checks(settings).context(
        "smollm2",
        [ChatMessage(role="user", content="hi")],
        REPLY_TOKENS,
        client_context=False,
        summary="We met.",
    )
    assert with_room.summarized and "We met." in with_room.messages[0].content


async def test_a_long_reply_leaves_the_rest_of_the_window_to_the_message(
    settings: Settings,
) -> None:
    """max_tokens 2000 with "hi" was a 413 naming `content` ("only 0 fit"): the margin
    came off the whole window. One that leaves no room at all names `max_tokens`."""
    hi = [ChatMessage(role="user", content="hi")]
    assert checks(settings).context("smollm2", hi, 2000, client_context=False).messages[-1] == hi[0]
    with pytest.raises(ApiError) as refused:
        checks(settings).context("smollm2", hi, 2048, client_context=False)
    assert (refused.value.status, refused.value.param) == (400, "max_tokens")


@pytest.mark.parametrize(
    ("kind", "turns"),
    [
        ("title", [("user", "请用中文详细解释" * 100), ("assistant", "好的" * 128)]),
        ("summary", [("assistant" if i % 2 else "user", "word " * 300) for i in range(12)]),
    ],
)
async def test_a_title_or_summary_prompt_fits_the_window(
    settings: Settings, kind: str, turns: list[tuple[str, str]]
) -> None:
    """A job's transcript had no budget: a long Chinese first question made a title
    prompt the worker refused (the chat kept its provisional title), and twelve long
    turns a summary prompt refused, each later job covering more."""
    from producers.gateway.chat.jobs import (
        SUMMARY_INSTRUCTION,
        SUMMARY_TOKENS,
        TITLE_INSTRUCTION,
        TITLE_TOKENS,
        transcript,
    )

    instruction, max_tokens = {
        "title": (TITLE_INSTRUCTION, TITLE_TOKENS),
        "summary": (SUMMARY_INSTRUCTION, SUMMARY_TOKENS),
    }[kind]
    engine = await renderer(settings, "smollm2")
    job_checks = checks(settings)
    content = transcript(
        turns, None, lambda text: job_checks.fits("smollm2", instruction, text, max_tokens)
    )
    prompt = [
        ChatMessage(role="system", content=instruction),
        ChatMessage(role="user", content=content),
    ]
    assert (
        len(engine.render_prompt(prompt)) + max_tokens <= settings.models["smollm2"].max_model_len
    )
    assert content.splitlines()[-1].startswith("Assistant: ")  # the newest turn is there


STRICT = (  # the check of Gemma 3's and Mistral's instruct templates
    "{%- set turns = messages[1:] if messages[0]['role'] == 'system' else messages -%}"
    "{%- for m in turns -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif -%}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor -%}"
)


async def test_the_chat_pages_history_renders_under_a_template_that_wants_turns_to_alternate(
    settings: Settings,
) -> None:
    """The chat page's history after a reply stopped before its first word, and cut so
    that its oldest kept turn was a reply: a model with such a template refused every
    later message of that chat."""
    from workers.engine import RequestFailed

    strict = await renderer(settings, "smollm2", STRICT)
    stopped_early = [ChatMessage(role="user", content="Tell me a story."), *chat("Short.", 1, 1)]
    with pytest.raises(RequestFailed, match="must alternate"):
        strict.render_prompt(stopped_early)
    long_ago = [ChatMessage(role="user", content="word " * 3000), *chat("Then?", 1, 1)[1:]]
    for asked in (stopped_early, long_ago):
        context = checks(settings).context("smollm2", asked, REPLY_TOKENS, client_context=False)
        strict.render_prompt(context.messages)  # taken
        assert context.messages[-1] == asked[-1]
    joined = checks(settings).context("smollm2", stopped_early, REPLY_TOKENS, False).messages
    assert joined[1].content == "Tell me a story.\n\nShort."
    cut = checks(settings).context("smollm2", long_ago, REPLY_TOKENS, False)
    assert [m.role for m in cut.messages] == ["system", "user"] and cut.dropped == 2
