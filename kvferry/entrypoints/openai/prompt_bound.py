"""The most characters of text one token can stand for, read from a ``tokenizer.json``.

With that number ``L``, a prompt of ``n`` characters has at least ``n / L`` tokens, so one with
more than ``max_model_len * L`` characters cannot fit the context and is refused before it is
tokenized. That holds when every character of the text ends up inside some token, and when a
token covers no more characters than its own string has:

- byte-level BPE (with all 256 bytes in its vocabulary): each character of a token string is
  one byte, and a character of text is at least one byte; byte-fallback tokens (``<0x41>``)
  cover one byte; an unknown-character token covers one; SentencePiece's ``▁`` stands for
  one space;
- normalizers that map characters to as many or more (decomposition, lowercasing, prepending,
  ``ByteLevel``, replacing a string by one at least as long) keep the count; composition
  (NFC/NFKC) merges at most four code points into one, so ``L`` is multiplied by 4.

Anything that can drop text (BERT-style normalizers, stripping, accents removal, whitespace
pre-tokenizers, splits that remove their delimiter, fused or word-level unknown tokens, added
tokens that swallow nearby whitespace, BPE without a token for every character, truncation,
unknown component types) makes the bound unknowable:
:func:`max_chars_per_token` then returns ``None`` and only the configured limits apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import pre_tokenizers

_SAFE_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}
_SPLITTERS = {"Split", "Punctuation"}  # safe unless their behaviour removes what they match
_MAX_COMPOSITION = 4


def _normalizer_factor(spec: dict[str, Any] | None) -> int | None:
    """How many input code points one normalized one may stand for; None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in spec.get("normalizers", []):
            f = _normalizer_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _SAFE_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSITION
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal and len(content) >= len(literal):
            return 1
    return None


def _pre_tokenizer_safe(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_safe(p) for p in spec.get("pretokenizers", []))
    if kind in _SPLITTERS:
        return str(spec.get("behavior", "Isolated")).lower() != "removed"
    return kind in _SAFE_PRE_TOKENIZERS


def _byte_level(spec: dict[str, Any]) -> bool:
    return '"ByteLevel"' in json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])


def _model_tokens(spec: dict[str, Any]) -> list[str] | None:
    """The model's token strings, when every character of input lands in some token."""
    model = spec.get("model")
    if not isinstance(model, dict):
        return None
    kind = model.get("type")
    if kind == "BPE" and not model.get("fuse_unk"):
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):
            return None
        # Without these, BPE silently drops characters it has no token for.
        if model.get("byte_fallback") or model.get("unk_token") is not None:
            return list(vocab)
        if _byte_level(spec) and set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
            return list(vocab)
        return None
    if kind == "Unigram" and model.get("byte_fallback"):
        return [str(entry[0]) for entry in model.get("vocab", [])]
    return None


def max_chars_per_token(spec: dict[str, Any]) -> int | None:
    """``L`` for a parsed ``tokenizer.json``, or None when no such bound holds."""
    if spec.get("truncation") is not None:
        return None  # a long text is cut to fit, not refused
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _pre_tokenizer_safe(spec.get("pre_tokenizer")):
        return None
    tokens = _model_tokens(spec)
    if tokens is None:
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    tokens += [str(t.get("content", "")) for t in added]
    return max(1, *map(len, tokens)) * factor


def max_chars_per_token_in(folder: str | Path) -> int | None:
    """:func:`max_chars_per_token` of ``folder/tokenizer.json`` (None if unreadable)."""
    try:
        spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return max_chars_per_token(spec) if isinstance(spec, dict) else None
