"""Streaming cadence of ``kvferry serve``: one SSE chunk per generated token, including tokens
whose text is empty (the model's vocabulary is larger than its tokenizer's, so many tokens
decode to nothing), and ``--stream-interval N``: the first token at once, then a chunk per N
tokens, the final chunk always; a bad ``--stream-interval`` is a one-line CLI error."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from kvferry.entrypoints.cli import main
from tests.helpers.servers import serving

PROMPT = "The ferry crossed the river at dawn"
N = 24
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0.0}
BODY |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    # The tokenizer trained for the tiny model has far fewer entries than 8192.
    return tiny_model_factory("llama", vocab=8192)


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
    return events


def _token_chunks(events: list[dict]) -> list[dict]:
    return [e["choices"][0] for e in events if e["choices"]]


def test_one_chunk_per_token(model, tmp_path) -> None:
    with serving("cadence", model, tmp_path) as server:
        events = _chunks(server.url, "/v1/completions", BODY)
        choices = _token_chunks(events)
        assert events[-1]["usage"]["completion_tokens"] == N
        assert len(choices) == N
        assert any(c["text"] == "" for c in choices)  # empty-text tokens get a chunk too
        assert [c["finish_reason"] for c in choices] == [None] * (N - 1) + ["length"]
        with_ids = _token_chunks(
            _chunks(server.url, "/v1/completions", {**BODY, "return_token_ids": True})
        )
        assert [len(c["token_ids"]) for c in with_ids] == [1] * N
        # Chat: the role chunk, then one chunk per token.
        chat = {k: v for k, v in BODY.items() if k != "prompt"}
        chat["messages"] = [{"role": "user", "content": PROMPT}]
        choices = _token_chunks(_chunks(server.url, "/v1/chat/completions", chat))
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert len(choices) == 1 + N


def test_stream_interval_coalesces(model, tmp_path) -> None:
    with serving("cadence4", model, tmp_path, None, "--stream-interval", "4") as server:
        body = {**BODY, "return_token_ids": True}
        sizes = [
            len(c["token_ids"]) for c in _token_chunks(_chunks(server.url, "/v1/completions", body))
        ]
    # vLLM's rule: the first token at once, then every 4 tokens, then whatever is left.
    assert sizes == [1, 4, 4, 4, 4, 4, 3] and len(sizes) == 1 + math.ceil((N - 1) / 4)


@pytest.mark.parametrize("value", ["0", "-2", "abc", "1.5"])
def test_bad_stream_interval_is_a_cli_error(value, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "/nonexistent", "--stream-interval", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err
        == f"kvferry serve: error: argument --stream-interval: must be a positive integer, got {value!r}"
    )
