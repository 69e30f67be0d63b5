"""Text in a message that spells one of the model's control tokens ("<|im_start|>",
"<start_of_turn>") stays text. The chat template's output is encoded with the
tokenizer's added tokens recognised anywhere in it, so such text became the token
itself: a user could write a turn of its own into the prompt (a system turn, or the
assistant's), through any surface, and into the title and summary jobs' prompts too.
Such text is spelled apart (tandoor/policies/control_text.py), as the gateway counts it."""

from __future__ import annotations

from typing import Any

from tandoor.policies.control_text import (
    ZERO_WIDTH_SPACE,
    control_tokens,
    found_in,
    spelled_apart,
)


class ControlTokens:
    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        """`chat_template`: the one prompts are rendered with, if not the tokenizer's."""
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        self._special = control_tokens(added, template if isinstance(template, str) else None)
        self._texts = sorted(set(self._special.values()), key=len, reverse=True)
        self._first_chars = frozenset(text[0] for text in self._texts)

    def defused(self, text: str) -> str:
        if not any(char in text for char in self._first_chars):
            return text  # most messages: no '<' at all
        try:  # where the tokenizer itself finds them: linear, however many it has
            encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a tokenizer without offsets
            return self._replaced(text)
        found = found_in(encoded["input_ids"], encoded["offset_mapping"], self._special)
        return spelled_apart(text, found)

    def _replaced(self, text: str) -> str:
        for control in self._texts:
            if control in text:
                text = text.replace(control, control[0] + ZERO_WIDTH_SPACE + control[1:])
        return text
