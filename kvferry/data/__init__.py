"""Data shipped with kvferry: an original English prose corpus (``corpus.txt``, ~50 KB) used
to train the tiny models' tokenizers and as a source of benchmark prompts."""

from __future__ import annotations

from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent / "corpus.txt"


def corpus_text() -> str:
    """The whole corpus as one string (UTF-8, paragraphs separated by blank lines)."""
    return CORPUS_PATH.read_text(encoding="utf-8")
