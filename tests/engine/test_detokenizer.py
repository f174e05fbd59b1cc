"""IncrementalDetokenizer: the deltas add up to decoding the whole output at once, whatever the
chunking, the tokenizer's decoder or the special tokens, and each step decodes a window whose
length does not grow with the output."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from kvferry.model.tiny import IM_END_ID, SPECIAL_TOKENS
from kvferry.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Héllo wörld, naïve café. 你好，世界！ Emoji 🙂🚀 and ascii tail."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory: Callable[..., Path]) -> Tokenizer:
    return Tokenizer(tiny_model_factory())


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(detok.add(ids[i : i + n]))
        i += n
    return "".join(out)


@pytest.mark.parametrize("seed", range(4))
def test_multibyte_text_in_any_chunking(tokenizer: Tokenizer, seed: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # byte-level BPE: the non-ASCII characters span several tokens each
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    joined = _stream(IncrementalDetokenizer(tokenizer), ids, random.Random(seed))
    assert joined == TEXT == tokenizer.decode(ids)


def test_incomplete_character_held_back_until_its_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert deltas[0] == "a" and deltas[-1] == "🙂"
    assert all(d == "" for d in deltas[1:-1]) and len(deltas) > 2


@pytest.mark.parametrize("seed", range(3))
def test_random_ids_match_whole_decode(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(400)]
    ids.append(tokenizer.encode(".", add_special_tokens=False)[0])  # end on a whole character
    for skip in (True, False):
        joined = _stream(IncrementalDetokenizer(tokenizer, skip), ids, random.Random(seed))
        assert joined == tokenizer.decode(ids, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    text_ids = tokenizer.encode("one two three", add_special_tokens=False)
    ids = [IM_END_ID, *text_ids[:2], IM_END_ID, IM_END_ID, *text_ids[2:], IM_END_ID]
    joined = _stream(IncrementalDetokenizer(tokenizer, skip), ids, random.Random(0))
    assert joined == tokenizer.decode(ids, skip)
    assert (SPECIAL_TOKENS[IM_END_ID] in joined) is not skip


def test_sentencepiece_leading_space(tmp_path: Path) -> None:
    """A Metaspace decoder drops the space of a sequence's first token only: "▁world" after
    "▁hello" must still come out as " world"."""
    words = ["<unk>", "▁hello", "▁world", "▁again", "ing", "!"]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    tokenizer = Tokenizer(tmp_path)
    ids = [1, 2, 4, 3, 5, 1]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert deltas == ["hello", " world", "ing", " again", "!", " hello"]
    assert "".join(deltas) == tokenizer.decode(ids)


def test_each_step_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    lengths: list[int] = []

    class Counting(Tokenizer):
        def __init__(self) -> None:  # shares the loaded tokenizer's state
            self.__dict__.update(tokenizer.__dict__)

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    ids = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(Counting())
    assert "".join(detok.add([t]) for t in ids) == TEXT * 40
    assert max(lengths) <= 12
