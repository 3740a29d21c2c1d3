"""How a failed exercise test reads in check()'s table: the difference first, "yours" and "expected" on two
aligned lines with the first differing item marked (a dict: the keys that differ), block hashes as short ids
(#5f66a1: the first 6 hex digits of the 64-bit value); then every "This looks like ..." hint, whole; then the
state the test started from, whole, one part a line (`render_failure`). Chapter: all.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any


def _shorten(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# A state dump inside a failure message: a bracketed span that opens with words ("[state before: ...",
# "[case 3: ...", "[temperatures ...", "[seq 4: ..."), unlike a value's repr ("[(4, 1, False)]", "[True]").
_DUMP_START = re.compile(r"\[[a-z][a-z_]*[ :]")
_HINT = re.compile(r"This looks like .*?\.(?=\s*(?:This looks like|\(|$))", re.S)
LEAD_CHARS = 900  # what is kept of the text between hints, should a difference be a huge repr
SHOWN_WHOLE = 150  # a value's repr up to this long is shown whole beside the other; longer, around the change
# a block hash (a chained 64-bit xxhash, or Python's hash): an integer of 12 digits or more
_HASH = re.compile(r"(?<![\w.#])-?\d{12,}(?![\w.])")
_YOURS = re.compile(r"\byours (?=[\[({])")
_EXPECTED = re.compile(r",? (?:expected|the engine's|the engine) (?=[\[({])")


def short_ids(text: str) -> str:
    """Block hashes (integers of 12 digits or more) as '#' and the first 6 hex digits of their 64-bit value:
    the same hash gets the same id wherever it appears."""
    return _HASH.sub(lambda m: "#" + format(int(m.group(0)) % (1 << 64), "x")[:6], text)


def _literal_end(text: str, i: int) -> int | None:
    """The end of the bracketed span (a repr, or a state dump) that opens at text[i], or None."""
    if i >= len(text) or text[i] not in "[({":
        return None
    depth, quote, j = 0, "", i
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"" and text[j - 1] in " [({,:":  # a string opens (an apostrophe in a word does not)
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _dumps(text: str) -> list[tuple[int, int]]:
    """(start, end) of each state dump in `text`, brackets balanced."""
    spans, i = [], 0
    while (m := _DUMP_START.search(text, i)) is not None:
        end = _literal_end(text, m.start()) or len(text)
        spans.append((m.start(), end))
        i = end
    return spans


def _top_level_split(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside brackets."""
    parts, depth, at = [], 0, 0
    for j, c in enumerate(text):
        depth += {"[": 1, "(": 1, "{": 1, "]": -1, ")": -1, "}": -1}.get(c, 0)
        if depth == 0 and text.startswith(sep, j):
            parts.append(text[at:j])
            at = j + len(sep)
    return [p.strip() for p in [*parts, text[at:]] if p.strip()]


def split_failure(message: str) -> tuple[str, list[str]]:
    """(lead, dumps) of a failure message. The lead is what to read first: the message without its state
    dumps, so the difference and every "This looks like ..." sentence come whole, in the message's order; the
    dumps are the state the test started from, each whole.

    "schedule() at step 19 [state before: ...]: scheduled ...: yours ..., expected .... This looks like ..."
    leads with "schedule() at step 19: scheduled ...: yours ..., expected .... This looks like ...", and the
    state follows it."""
    text = " ".join(message.split()).removeprefix("AssertionError: ")
    dumps = [text[a:b] for a, b in _dumps(text)]
    lead = text
    for dump in dumps:
        lead = lead.replace(dump, "")
    lead = " ".join(lead.split()).replace(" :", ":").replace(" .", ".")

    def cut(piece: str) -> str:  # (only in a pathological case) text that holds no difference to show
        return piece.strip() if _literal_pairs(piece) else _shorten(piece, LEAD_CHARS)

    pieces, at = [], 0
    for m in _HINT.finditer(lead):
        pieces += [cut(lead[at:m.start()]), m.group(0)]
        at = m.end()
    lead = " ".join(p for p in [*pieces, cut(lead[at:])] if p)
    return lead, dumps


def _literal_pairs(text: str) -> list[tuple[int, int, str, str]]:
    """(start, end, yours, expected) of each "yours <repr>, expected <repr>" in `text` (both bracketed)."""
    pairs, i = [], 0
    while (m := _YOURS.search(text, i)) is not None:
        a1 = _literal_end(text, m.end())
        sep = _EXPECTED.match(text, a1) if a1 else None
        b1 = _literal_end(text, sep.end()) if sep else None
        if b1 is None:
            i = m.end()
            continue
        pairs.append((m.start(), b1, text[m.end():a1], text[sep.end():b1]))
        i = b1
    return pairs


def _r(x: Any) -> str:
    return short_ids(repr(x))


def _items(value: Any) -> str:
    """A list's or tuple's repr with block hashes as short ids."""
    inner = ", ".join(_r(x) for x in value)
    return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"


def difference(got: str, want: str) -> list[str]:
    """The lines that show how the repr `got` differs from the repr `want`: both on aligned lines with the
    first differing item marked (a list or tuple), or the keys that differ (a dict)."""
    try:
        g, w = ast.literal_eval(got), ast.literal_eval(want)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        g = w = None
    if isinstance(g, dict) and isinstance(w, dict):
        lines = []
        if len(_r(g)) + len(_r(w)) <= 2 * SHOWN_WHOLE:
            lines += [f"yours    {_r(g)}", f"expected {_r(w)}"]
        keys = [k for k in w if k in g and g[k] != w[k]]
        extra, missing = [k for k in g if k not in w], [k for k in w if k not in g]
        for k in keys[:6]:
            lines.append(f"at {_r(k)}: yours {_r(g[k])}, expected {_r(w[k])}")
        if len(keys) > 6:
            lines.append(f"... and {len(keys) - 6} more keys differ")
        for what, ks, d in (("keys only yours have", extra, g), ("keys yours lack", missing, w)):
            if ks:
                shown = ", ".join(f"{_r(k)}: {_r(d[k])}" for k in ks[:6])
                lines.append(f"{what} ({len(ks)}): {shown}{', ...' if len(ks) > 6 else ''}")
        return lines
    if isinstance(g, (list, tuple)) and isinstance(w, (list, tuple)):
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        whole = max(len(_items(g)), len(_items(w))) <= SHOWN_WHOLE
        lo, hi = (0, max(len(g), len(w))) if whole else (max(0, i - 2), i + 3)
        shown = []
        for v in (g, w):
            s = _items(type(v)(v[lo:hi]))
            s = s[:-1] + ", ...]" if len(v) > hi else s
            shown.append("[..., " + s[1:] if lo else s)
        gs, ws = shown
        prefix = "[..., " if lo else ""
        at = len(prefix or "[") + sum(len(_r(x)) + 2 for x in g[lo:i])
        where = (f"item {i}: yours {_r(g[i]) if i < len(g) else 'nothing'}, expected "
                 f"{_r(w[i]) if i < len(w) else 'nothing'}")
        if len(g) != len(w):
            where += f" (yours has {len(g)} items, expected {len(w)})"
        return [f"yours    {gs}", f"expected {ws}", " " * (9 + at) + "^ " + where]
    a, b = short_ids(got), short_ids(want)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return [f"yours    {a}", f"expected {b}", " " * (9 + at) + "^"]


def render_failure(name: str, message: str, width: int = 110) -> list[str]:
    """The table's lines for a failed test: the difference (yours and expected aligned) and the hints first,
    whole; then the state the test started from, whole, one part a line."""
    lead, dumps = split_failure(message)
    lines: list[str] = []
    text, first = f"-> {name}: ", True

    def say(words: str) -> None:
        nonlocal first
        if words.strip():
            lines.extend(textwrap.wrap(short_ids(words), width, initial_indent=" " * (9 if first else 12),
                                       subsequent_indent=" " * 12, break_on_hyphens=False))
            first = False

    at = 0
    for start, end, got, want in _literal_pairs(lead):
        if len(got) + len(want) < 60 and not got.startswith("{"):  # a short list reads well inline
            continue
        say(text + lead[at:start].rstrip())
        text = ""
        lines.extend(" " * 14 + line for line in difference(got, want))
        at = end
    say(text + lead[at:].lstrip(" ,;:."))
    for dump in dumps:
        parts = _top_level_split(dump[1:-1], "; ")
        for k, part in enumerate(parts):
            lines.extend(textwrap.wrap(short_ids(part), width, initial_indent=" " * (12 if k == 0 else 14),
                                       subsequent_indent=" " * 16, break_on_hyphens=False))
    if _HASH.search(message):
        lines.append(" " * 12 + "(#5f66a1 and the like: block hashes, by the first 6 hex digits of their "
                     "64-bit value)")
    return lines
