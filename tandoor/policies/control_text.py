"""Text that spells one of a model's control tokens ("<|im_start|>", "<start_of_turn>")
stays text: a zero-width space after its first character keeps the tokenizer from
matching it, and the model reads nearly the same characters. The worker renders
messages so (workers/control_tokens.py); the gateway counts them so, or it took such
text for a token or two where the worker saw several, and accepted prompts the worker
then refused as longer than the context window."""

from __future__ import annotations

from collections.abc import Iterable

ZERO_WIDTH_SPACE = "\u200b"


def spelled_apart(text: str, found: Iterable[tuple[str, int, int]]) -> str:
    """`text` with each control token the tokenizer found in it, as (its text, start,
    end of its span), spelled apart. A token's own text is looked for within its span:
    one that takes the space before it (lstrip) has a span that starts at that space."""
    cuts = [at + 1 for control, start, end in found if (at := text.find(control, start, end)) >= 0]
    pieces, at = [], 0
    for cut in cuts:
        pieces += [text[at:cut], ZERO_WIDTH_SPACE]
        at = cut
    return "".join([*pieces, text[at:]])
