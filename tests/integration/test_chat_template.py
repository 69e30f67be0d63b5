"""A model's chat-template override is what the worker renders prompts with (the bundled
model's real tokenizer; no engine needed for rendering)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from schemas.events import ChatMessage
from tandoor.settings import Settings
from workers.engine import Engine
from workers.model_store import resolve_model_dir

pytestmark = pytest.mark.integration

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


async def test_the_override_replaces_the_tokenizers_template(settings: Settings) -> None:
    from transformers import AutoTokenizer

    folder = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
    messages = [ChatMessage(role="user", content="Hello there")]
    default = Engine(cast(Any, None), tokenizer, 2048)
    custom = Engine(cast(Any, None), tokenizer, 2048, TEMPLATE)

    assert "<|im_start|>" in tokenizer.decode(default.render_prompt(messages))
    assert tokenizer.decode(custom.render_prompt(messages)) == "[user] Hello there\n[assistant] "
    # A continued reply ends with its partial text, not with a new assistant turn.
    continued = tokenizer.decode(custom.render_prompt(messages, "General Ken"))
    assert continued == "[user] Hello there\n[assistant] General Ken"
