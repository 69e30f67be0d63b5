"""Moderation of what users send and what the model says; pluggable.

The default: a configurable blocklist refuses a message outright, and personal data
(e-mail addresses, phone numbers, payment card numbers) is redacted, in the input
before it reaches the model, in the reply as it streams, and in the reply as stored.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import re2

# Every pattern runs on RE2 (google-re2): matching is linear in the input whatever the
# pattern or the text, so no reply or message can make a check backtrack for seconds
# (Python's re took 4.8 s on 24 digits and a letter in the streaming hold pattern, and
# doubled with each further digit). RE2 has no look-behind, so a pattern that must not
# start inside a word captures the character before it (group 1) and keeps it.
WORD = r"\p{L}\p{N}_"  # Unicode word characters, as Python's \w (RE2's \w is ASCII)
# Local part, @, then dotted labels ending in a word character. Over-redacts
# punctuation run into the local part rather than leave an address visible.
EMAIL = re2.compile(rf"()([{WORD}.+\-]+@[{WORD}\-]+(?:\.[{WORD}\-]*[{WORD}])+)")
# A reply that ends inside an address (a stop string cut it there): what is left
# matches no address, and would show its local part. Replies only (a message ending in
# "ssh root@server" is the user's own), and an ASCII local part standing alone: in
# Chinese or Japanese, written without spaces, "...玩吧@小明" is a mention.
CUT_EMAIL = re2.compile(rf"(^|[^{WORD}])([A-Za-z0-9._%+\-]+@[{WORD}\-.]*)$")
CARD = re2.compile(r"()\b((?:\d[ -]?){12,18}\d)\b")
_CARD_SEPARATOR = re.compile(r"([ -])")  # within a [card] match: one character
_CARD_GROUP = 4  # the fewest digits of a card's own group (4-4-4-4, 4-6-5)
_CARD_GROUPINGS = frozenset({(4, 4, 4, 4), (4, 4, 4, 4, 3), (4, 6, 5), (4, 6, 4)})
# By length, the first digits of the cards that have it (Visa's 13, Diners' 14, Amex's 15).
_CARD_FIRST_DIGITS = {13: "4", 14: "3", 15: "3", 16: "23456", 17: "456", 18: "456", 19: "456"}
# Scripts written without spaces: a letter of theirs before the digits is not a word
# the number would start inside of.
_UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}"
PHONE = re2.compile(rf"(^|[^{WORD}+]|[{_UNSPACED}])(\+?\d[\d ().-]{{7,}}\d)\b")
# What the [phone] pattern's shape also takes and a phone number is not: a date at its
# start (then the rest is looked at again), and digits with dots only where every group
# is short (an address like 192.168.100.200, a version) or one dot splits them (3.14159).
_ISO_DATE = re2.compile(r"^\d{4}-\d{2}-\d{2}")
_DATE_CHARS = 10
_DOTTED = re2.compile(r"^\d+(?:\.\d+)+$")
_PHONE_DIGITS = range(9, 16)  # E.164 has at most 15; 9 is the shortest national number
# What a streamed reply may still turn into something to redact is held back. Text
# without '@' or a digit: only its trailing run of the characters an address's local
# part is made of ("Hello!" is sent whole, "Hello" is held). Otherwise its last,
# unfinished word (a run of the characters a match is made of: an address has no
# spaces, and Chinese or Japanese, without them, have punctuation) and a trailing run of
# a phone's characters with the word it runs into (a phone, a card, a list of cards:
# "4111 1111 1111 1111," is not cut), moved back so that no word is cut, nor such a run
# with a digit in it that is long enough for a match and runs on into the held text.
# All held back whole up to HOLD_CHARS, so anything shorter is redacted exactly as in
# the stored reply; a longer run is released in pieces (each search is bounded by
# HOLD_CHARS, so a stream costs linear time however it is cut).
_WORDISH = rf"[{WORD}.+\-@]"  # what a match is made of, besides a phone's spaces
_LAST_WORD = re2.compile(rf"{_WORDISH}*$")
_DIGIT_RUN = re2.compile(rf"(?:\+?\d[\d ().-]*|\+){_WORDISH}*$")  # as in [phone]
_PHONE_RUN_TAIL = re2.compile(r"[\d ().+\-]*$")  # what [phone] and [card] are made of
_DIGIT = re2.compile(r"\d")
_LOCAL_PART_TAIL = re2.compile(rf"[{WORD}.+\-]*$")  # as in the [email] pattern
_ASCII_LOCAL_PART = string.ascii_letters + string.digits + "_.+-"
_ASCII_DIGITS = frozenset(string.digits)  # RE2's \d
_ASCII_WORD = frozenset(string.ascii_letters + string.digits + "_")  # RE2's \b
_PHONE_CHARS = frozenset(string.digits + " ().+-")  # as in _PHONE_RUN_TAIL
_RUN_CHARS = frozenset(string.digits + " ().-")  # what [\d ().-]* takes, in _DIGIT_RUN
HOLD_CHARS = 4096
_SHORTEST_MATCH = 9  # [phone]: nine digits at least ([card] is longer)
_SHORT_HOLD = 64
# Every pattern needs one. Python's re here: one character class cannot backtrack, and
# a call costs a fifth of RE2's wrapper (this runs on every streamed event). [0-9] is
# RE2's \d (Python's would take other scripts' digits too).
_MAYBE_PERSONAL = re.compile(r"[@0-9]")
_ASCII_WORDISH = _ASCII_LOCAL_PART + "@"  # _WORDISH, in ASCII
_MATCH_LOOKBACK = 320  # the longest address (64 + 1 + 255): a longer match is no one's


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    text: str  # the text to use: redacted where needed
    reason: str | None = None


class Moderator(Protocol):
    def check_input(self, text: str) -> Verdict: ...

    def output_filter(self) -> OutputFilter: ...

    def check_output(self, text: str) -> str:
        """A whole reply as it is stored: what output_filter streams, all at once."""


class OutputFilter(Protocol):
    def feed(self, chunk: str) -> str:
        """Text safe to send now; may hold back the end of `chunk` until more arrives."""

    def flush(self) -> str: ...


class DefaultModerator:
    def __init__(self, blocklist: Iterable[str] = ()) -> None:
        terms = sorted({t.strip().lower() for t in blocklist if t.strip()})
        alternatives = "|".join(re2.escape(t) for t in terms)
        # Whole words only, in any script: the term, with no word character either side.
        self._blocked = (
            re2.compile(rf"(?i)(?:^|[^{WORD}])({alternatives})(?:$|[^{WORD}])") if terms else None
        )

    def check_input(self, text: str) -> Verdict:
        if self._blocked is not None and (hit := self._blocked.search(text)):
            return Verdict(False, text, f"the message contains a blocked term ({hit[1]!r})")
        return Verdict(True, redact(text))

    def output_filter(self) -> OutputFilter:
        return StreamRedactor()

    def check_output(self, text: str) -> str:
        return redact_reply(text)


class StreamRedactor:
    """Redacts a streamed reply, holding back only what could still grow into a match."""

    def __init__(self) -> None:
        self._pending = ""
        self._plain = True  # the held text has no '@' and no digit: a local part's run
        self._digit_run = False  # it is a digit, then only [\d ().-]: all of it is held

    def feed(self, chunk: str) -> str:
        text = self._pending + chunk
        if self._digit_run and len(text) <= HOLD_CHARS and _RUN_CHARS.issuperset(chunk):
            # Held whole, as a search would find (a [phone] or [card] may run through
            # all of it): "1 1 1 ..." searched all the hold again at each event.
            self._pending = text
            return ""
        if self._plain and not _MAYBE_PERSONAL.search(chunk):  # most: an address's start
            # What is held is such a run already: only the chunk is looked at. Capped as
            # below: a run of letters ("hahaha...") was held whole, each event searching
            # all of it again.
            start = _local_part_start(chunk)
            hold = max(len(self._pending) + start if start else 0, len(text) - HOLD_CHARS)
            self._pending = text[hold:]
            return text[:hold]
        hold = _hold_from(text)
        ready, self._pending = text[:hold], text[hold:]
        self._plain = not _MAYBE_PERSONAL.search(self._pending)
        self._digit_run = self._pending[:1] in _ASCII_DIGITS and _RUN_CHARS.issuperset(
            self._pending
        )
        return redact(ready)

    def flush(self) -> str:
        rest, self._pending, self._plain, self._digit_run = self._pending, "", True, False
        return redact_reply(rest)


def _hold_from(text: str) -> int:
    """Where the part that may still grow into a match starts. Looked for in a short
    window first (a word), and in the whole HOLD_CHARS only when it reaches back that far."""
    for window in (_SHORT_HOLD, HOLD_CHARS):
        start = max(0, len(text) - window)
        found = [m.start() for p in (_LAST_WORD, _DIGIT_RUN) if (m := p.search(text, start))]
        hold = min(found, default=len(text))
        if hold > start or start == 0:
            break
    # Past the cap, half of it is released at once: a longer run is searched again once
    # every HOLD_CHARS / 2 characters, not at every event.
    floor = len(text) - HOLD_CHARS // 2 if len(text) > HOLD_CHARS else 0
    hold = _not_inside_a_match(text, hold, floor)
    return _past_cut_matches(text, hold) if floor > 0 else hold


def _past_cut_matches(text: str, cut: int) -> int:
    """A release where the hold reaches HOLD_CHARS: moved past the end of any match it
    would cut that redaction replaces (the hold could not keep it whole), so that it is
    redacted whole. Released in pieces, an address or a number before a long run
    ("john.doe@corp.com-----...") went out as typed: no piece held all of it. One
    redaction leaves as it is (digits not yet a phone's) keeps the cut: released
    whole, it went out before the rest of the phone arrived. Only matches within
    _MATCH_LOOKBACK either side of the cut are looked at: each event costs that, not
    the whole hold."""
    moved = True
    while moved:
        moved = False
        for pattern, replaced in _REDACTED:
            window = (max(0, cut - _MATCH_LOOKBACK), cut + _MATCH_LOOKBACK)
            for match in pattern.finditer(text, *window):
                if match.start(2) >= cut:
                    break
                if cut < match.end(2) and replaced(match.group(2)):
                    cut, moved = match.end(2), True
    return cut


def _not_inside_a_match(text: str, hold: int, floor: int) -> int:
    """`hold`, moved back until it cuts neither a word (a digit run can begin inside an
    address: "bob@10.0.0.1" held from "1" released "bob@10.0.0.") nor a run of a
    phone's characters with a digit in it that a match could run through into the held
    text (a phone may span words: "0)  9()9(0"). A run the held text cannot continue
    stays out: "x1 x1 x1 ..." was held back up to HOLD_CHARS, a word a step, each step
    a search of the whole hold (seconds of the gateway's loop on one reply)."""
    while True:
        start = floor + _last_word_start(text[floor:hold])
        run = _PHONE_RUN_TAIL.search(text[floor:start])
        if (
            run
            and _DIGIT.search(run.group())
            and _may_run_on(text, start, start - floor - run.start())
        ):
            start = floor + run.start()
        if start == hold:
            return hold
        hold = start


def _may_run_on(text: str, start: int, before: int = _SHORTEST_MATCH) -> bool:
    """Whether a [phone] or [card] match may run from before `start` into the text from
    it: the phone characters it starts with could end one (a digit with no ASCII word
    character after it: RE2's \b), or may still grow."""
    if start == len(text):
        return True
    if text[start - 1] not in _PHONE_CHARS:  # the run ended before the word
        return False
    for i in range(start, len(text)):
        if text[i] not in _PHONE_CHARS:
            return False
        if text[i] in _ASCII_DIGITS and (i + 1 == len(text) or text[i + 1] not in _ASCII_WORD):
            if i + 1 == len(text) or before + i + 1 - start >= _SHORTEST_MATCH:
                return True
    return True  # phone characters to the end: it may still grow


def _local_part_start(text: str) -> int:
    """Where the trailing run of characters an address's local part may hold starts.
    Looked for in the last word only; str.rstrip where the word is ASCII (exact there),
    RE2's own classes elsewhere (its reverse scan of a pattern anchored at the end reads
    just that run)."""
    word = _last_word_start(text)
    tail = text[word:]
    if tail.isascii():
        return word + len(tail.rstrip(_ASCII_LOCAL_PART))
    match = _LOCAL_PART_TAIL.search(text, word)
    return match.start() if match else len(text)


def _last_word_start(text: str) -> int:
    """Where the trailing run of characters a match can be made of starts (a word, also
    in scripts written without spaces, where punctuation ends it). str.rstrip where the
    text is ASCII (exact there, and several times quicker than a search)."""
    if text.isascii():
        return len(text.rstrip(_ASCII_WORDISH))
    m = _LAST_WORD.search(text)
    return m.start() if m else len(text)


def redact_reply(text: str) -> str:
    """A whole reply, or its end: an address cut off there is redacted too."""
    text = redact(text)
    return CUT_EMAIL.sub(r"\1[email]", text) if "@" in text else text


def redact(text: str) -> str:
    if not _MAYBE_PERSONAL.search(text):
        return text  # most of a streamed reply: no '@', no digit
    text = EMAIL.sub(r"\1[email]", text)
    text = CARD.sub(_card_or_not, text)
    return PHONE.sub(_phone_or_not, text)


def _card_or_not(match: re2._Match[str]) -> str:
    """A card number passes the Luhn check (an ISBN or an order number mostly does not).
    The match may have taken in a short group beside the card (its expiry, its CVV, a
    count before it: "4111 1111 1111 1111 12/25"), which fails the check: the card is
    then what is left without the groups of fewer than four digits at either end."""
    number = match.group(2)
    if _luhn_valid(number):
        return "[card]"
    parts = _CARD_SEPARATOR.split(number)  # groups, with the separators between them
    first, last = 0, len(parts) - 1
    while first < last and len(parts[first]) < _CARD_GROUP:
        first += 2
    while last > first and len(parts[last]) < _CARD_GROUP:
        last -= 2
    core = "".join(parts[first : last + 1])
    shaped = core != number and _card_shaped(parts[first : last + 1 : 2])
    if not (shaped and _luhn_valid(core)):
        return number
    return "".join(parts[:first]) + "[card]" + "".join(parts[last + 1 :])


def _card_shaped(groups: list[str]) -> bool:
    """Written as cards are: 4-4-4-4(-3), 4-6-5 or 4-6-4, or unbroken with a card's
    length and first digit. Any 13 to 19 digits left beside a short group doubled the
    false [card]s (a timestamp and a status code, a quantity and a barcode)."""
    if len(groups) > 1:
        return tuple(map(len, groups)) in _CARD_GROUPINGS
    (digits,) = groups
    return digits[:1] in _CARD_FIRST_DIGITS.get(len(digits), "")


def _luhn_valid(number: str) -> bool:
    digits = [int(c) for c in reversed(number) if c in _ASCII_DIGITS]
    doubled = [d * 2 - 9 if d * 2 > 9 else d * 2 for d in digits[1::2]]
    return (sum(digits[::2]) + sum(doubled)) % 10 == 0


def _phone_or_not(match: re2._Match[str]) -> str:
    return match.group(1) + _phone_label(match.group(2))


def _phone_label(number: str) -> str:
    """A [phone] match as redacted. One that starts with a date ("2024-01-15 10") keeps
    the date, and the rest is looked at again, as [phone] would find it there; in a
    loop, each step a search of a window the size of the step (a call a date, each a
    search of all the rest, overflowed Python's stack at 180 dates, and took 6 s at
    5,000 when a loop)."""
    at = 0
    while _ISO_DATE.search(number[at : at + _DATE_CHARS]):
        start = _phone_start(number, at + _DATE_CHARS)
        if start is None:
            return number
        at = start
    rest = number[at:]
    digits = sum(c in _ASCII_DIGITS for c in rest)
    phone = digits in _PHONE_DIGITS and not _is_dotted_number(rest)
    return number[:at] + ("[phone]" if phone else rest)


def _phone_start(number: str, start: int) -> int | None:
    """Where [phone] first matches in number[start:] (a match's own characters, after a
    date), searched in a window doubled until it holds one. A match found in a window
    is the first in all of it: the characters are all a phone's and the number ends in
    a digit, so any earlier start would match in the same window too. A match runs to
    the number's end."""
    window = 64
    while True:
        end = min(len(number), start + window)
        if found := PHONE.search(number[start:end]):
            return start + found.start(2)
        if end == len(number):
            return None
        window *= 2


def _is_dotted_number(number: str) -> bool:
    if not _DOTTED.search(number):
        return False
    groups = number.split(".")
    return len(groups) == 2 or all(len(group) <= 3 for group in groups)


# What each pattern's match is replaced by redact() when (the streaming cut's concern).
_REDACTED: tuple[tuple[re2._Regexp[str], Callable[[str], bool]], ...] = (
    (EMAIL, lambda _: True),
    (CARD, _luhn_valid),
    (PHONE, lambda number: _phone_label(number) != number),
)
