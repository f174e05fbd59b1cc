"""Tokenizer: a thin layer over a Hugging Face ``tokenizer.json`` (the `tokenizers` library).

Reads ``tokenizer_config.json`` for the special tokens and the chat template, and
``generation_config.json`` for extra end-of-sequence ids, so that encoding and decoding
match ``transformers``' fast tokenizer on the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvferry.config import ConfigError


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"tokenizer folder {str(folder)!r} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ConfigError(f"{tok_file} could not be loaded: {e}") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        eos: list[int] = []
        if (
            self.eos_token is not None
            and (tid := self._tok.token_to_id(self.eos_token)) is not None
        ):
            eos.append(tid)
        gen_eos = gen.get("eos_token_id")
        for tid in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(tid, int) and tid not in eos:
                eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it (``convert_ids_to_tokens``)."""
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ConfigError("this tokenizer has no chat_template in tokenizer_config.json")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Each step decodes only a short window: the tokens since the last emitted text plus the
    ones just before them (``_prefix``), whose own text is subtracted. The context token keeps
    decoders that treat a sequence's first token specially (SentencePiece's leading space)
    from changing the delta, so the deltas add up to decoding the whole output at once, in
    time independent of its length. A delta ending in a replacement character means an
    incomplete multi-byte character; it is held back until the character's last token arrives.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix = 0  # first token of the decoded window
        self._read = 0  # first token whose text has not been emitted

    def add(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix : self._read], self._skip)
        window_text = decode(self.token_ids[self._prefix :], self._skip)
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return window_text[len(prefix_text) :]
