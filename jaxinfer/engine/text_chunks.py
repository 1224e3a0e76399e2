"""Cutting a long text where its tokenization does not change, so the pieces encode in parallel (``tokenizers``'
``encode_batch`` runs a batch on all cores) and their ids concatenate to the ids of the whole text.

A byte-level BPE tokenizer encodes each pre-tokenizer piece on its own, so a cut between two pieces is safe if the
pieces on either side are the same with and without the other side: a regex piece can depend on what follows it
(GPT-2's ``\\s+(?!\\S)`` leaves "\\n\\n" whole at the end of a text but splits it before a word). ``safe_cuts`` takes
candidate cuts at single newlines between non-space characters, about every ``chunk_chars`` characters, and keeps
one only if the tokenizer's own pre-tokenizer, run on a window around it, gives the same pieces as it does on the
two halves of the window, and no added token (matched before pre-tokenization) spans it. A tokenizer with a
normalizer, or whose pre-tokenizer adds a prefix space, is never cut (``can_cut``).
"""

from __future__ import annotations

import re

CHUNK_CHARS = 16384       # characters per piece (~4k tokens): enough pieces for the cores, each worth a task
WINDOW = 256              # characters on either side of a cut that the check pre-tokenizes
_CANDIDATE = re.compile(r"(?<=\S)\n(?=\S)")


def can_cut(tokenizer_json: dict) -> bool:
    """Whether texts of this tokenizer (its tokenizer.json) may be cut: no normalizer (offsets are the text's) and
    no pre-tokenizer that adds a prefix space or marker at the start of a text (ByteLevel add_prefix_space,
    Metaspace), which a cut would add again."""
    if tokenizer_json.get("normalizer") is not None:
        return False

    def ok(pre) -> bool:
        if pre is None:
            return False
        kind = pre.get("type")
        if kind == "Sequence":
            return all(ok(p) for p in pre.get("pretokenizers", []))
        if kind == "ByteLevel":
            return not pre.get("add_prefix_space", False)
        return kind in ("Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit")

    return ok(tokenizer_json.get("pre_tokenizer"))


def safe_cuts(text: str, pre_tokenize, added_tokens: list[str], chunk_chars: int = CHUNK_CHARS) -> list[int]:
    """Positions to cut ``text`` at (increasing, neither 0 nor len(text)). pre_tokenize: str -> [(piece, (start,
    end))] (``tokenizers``' ``pre_tokenizer.pre_tokenize_str``); added_tokens: the strings matched before
    pre-tokenization."""
    cuts, target = [], chunk_chars
    while target < len(text) - chunk_chars // 4:
        m = _CANDIDATE.search(text, target)
        while m is not None and not _safe(text, m.end(), pre_tokenize, added_tokens):
            m = _CANDIDATE.search(text, m.end())
        if m is None:
            break
        cuts.append(m.end())
        target = m.end() + chunk_chars
    return cuts


def _safe(text: str, cut: int, pre_tokenize, added_tokens: list[str]) -> bool:
    for token in added_tokens:
        if token in text[max(0, cut - len(token) + 1):cut + len(token) - 1]:
            return False
    start, end = max(0, cut - WINDOW), min(len(text), cut + WINDOW)
    pieces = lambda s, shift: [(p, (a + shift, b + shift)) for p, (a, b) in pre_tokenize(s)]  # noqa: E731
    whole = pieces(text[start:end], start)
    left, right = pieces(text[start:cut], start), pieces(text[cut:end], cut)
    return whole == left + right
