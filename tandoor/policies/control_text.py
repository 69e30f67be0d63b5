"""Text that spells one of a model's control tokens ("<|im_start|>", "<start_of_turn>")
stays text: a zero-width space after its first character keeps the tokenizer from
matching it, and the model reads nearly the same characters. The worker renders
messages so (workers/control_tokens.py); the gateway counts them so, or it took such
text for a token or two where the worker saw several, and accepted prompts the worker
then refused as longer than the context window."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ZERO_WIDTH_SPACE = "\u200b"


def control_tokens(added: Mapping[int, Any], template: str | None) -> dict[int, str]:
    """id: text of each added token a message must not spell: the special ones (an
    unknown word's id is not one: <unk> stands for text that is not its own), and the
    others the chat template writes (DeepSeek's distilled tokenizers do not mark their
    turns special, and a tokenizer matches added tokens anywhere all the same)."""
    written = template or ""
    return {
        i: t.content
        for i, t in added.items()
        if t.content and (t.special or (not t.content.isspace() and t.content in written))
    }


def rendering_template(folder: Path, override: Path | None) -> str | None:
    """The template the worker renders with: the config's file, else the folder's (an
    override the worker cannot read stops it at start, with the reason)."""
    if override is not None:
        try:
            return override.read_text(encoding="utf-8")
        except (OSError, ValueError):
            pass
    return folder_template(folder)


def folder_template(folder: Path) -> str | None:
    """The chat template a model folder's tokenizer carries, if it is text."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def found_in(
    ids: Iterable[int], offsets: Iterable[tuple[int, int]], controls: Mapping[int, str]
) -> list[tuple[str, int, int]]:
    """Each control token among a text's encoded ids: (its text, start, end of its span)."""
    spans = zip(ids, offsets, strict=True)
    return [(controls[i], start, end) for i, (start, end) in spans if i in controls]


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
