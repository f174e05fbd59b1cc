"""Intake validation: every sampling and request field is checked before it reaches the engine,
so one bad request is a 400 naming the parameter, never a failed step for its batch mates or a
dead engine. SamplingParams' ranges (the Python API), the prompt-length bound, and each attack
of issue #11 against a real ``kvferry serve``."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError
from kvferry.entrypoints.openai.prompt_bound import max_chars_per_token, max_chars_per_token_in
from kvferry.sampling_params import MIN_TOP_P
from tests.helpers.servers import OFFLINE_KW, serving

# -- SamplingParams (the Python API) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1e-9}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_sampling_params_refuse_out_of_range(kwargs: dict, param: str) -> None:
    with pytest.raises(ConfigError, match=param) as e:
        SamplingParams(**kwargs)
    assert getattr(e.value, "param", None) == param


def test_sampling_params_edges_that_are_valid() -> None:
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P
    assert SamplingParams(top_p=0.5).top_p == 0.5
    for seed in (2**64 - 1, -(2**63), 0):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(stop_token_ids=[5, 5, 7]).stop_token_ids == [5, 7]
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.fixture(scope="module")
def offline(tiny_model_factory) -> LLM:
    return LLM(model=str(tiny_model_factory("llama")), **OFFLINE_KW)


def _ids(llm: LLM, prompt, **kw) -> list[int]:
    params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_offline_llm_refuses_and_survives_hostile_params(offline: LLM) -> None:
    greedy = _ids(offline, "The ferry", temperature=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        _ids(offline, "The ferry", temperature=float("nan"))
    with pytest.raises(ConfigError, match="surrogate"):
        _ids(offline, "a\ud800b")
    with pytest.raises(ConfigError, match="stop_token_ids"):
        _ids(offline, "The ferry", stop_token_ids=[10**6])
    # Tiny temperatures are greedy; a tiny top_p keeps only the most likely token.
    assert _ids(offline, "The ferry", temperature=1e-40) == greedy
    assert _ids(offline, "The ferry", temperature=1.0, top_p=1e-300) == greedy
    assert len(_ids(offline, "The ferry", temperature=1.0, seed=2**64 - 1)) == 8
    assert offline.engine.scheduler.get_num_unfinished_requests() == 0


# -- the character bound on prompts -----------------------------------------------------------


def test_char_bound_holds_for_the_tiny_tokenizer(offline: LLM, tiny_model_factory) -> None:
    per_token = max_chars_per_token_in(tiny_model_factory("llama"))
    assert per_token is not None and per_token >= 2
    tok, rng = offline.get_tokenizer(), random.Random(0)
    alphabet = "ab cd\n\t.,;ee  é中文🙂" + "".join(map(chr, range(32, 127)))
    for n in (1, 7, 64, 700, 3000):
        for _ in range(5):
            text = "".join(rng.choice(alphabet) for _ in range(n))
            assert len(tok.encode(text)) * per_token >= len(text)
    # The longest vocabulary entry repeated: as few tokens per character as text can get.
    assert len(tok.encode("<|begin_of_text|>" * 50)) * per_token >= 17 * 50


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "BertNormalizer", "clean_text": True}},
        {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
        {"truncation": {"max_length": 8}},
        {"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "[UNK]"}},
        {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "fuse_unk": True}},
        {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}},  # drops unknown chars
        {"added_tokens": [{"id": 0, "content": "<m>", "lstrip": True, "rstrip": False}]},
    ],
)
def test_char_bound_is_off_when_text_can_vanish(tiny_model_factory, change: dict) -> None:
    spec = json.loads((tiny_model_factory("llama") / "tokenizer.json").read_text())
    assert max_chars_per_token(spec) == 17
    spec.update(change)
    assert max_chars_per_token(spec) is None


def test_char_bound_counts_composition() -> None:
    base = {
        "model": {"type": "BPE", "vocab": {"abc": 0}, "merges": [], "unk_token": "<unk>"},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"},
        "normalizer": {"type": "NFKC"},
    }
    assert max_chars_per_token(base) == 4 * len("abc")  # an unknown character: one token
    base["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert max_chars_per_token(base) == 3


# -- attacks against a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("intake")
    with serving("intake", tiny_model_factory("llama"), logs) as inst:
        yield inst


def _post(server, body: dict | str | bytes, path: str = "/v1/completions", timeout: float = 60):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def _bad(resp: httpx.Response, param: str | None, status: int = 400) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return str(err["message"])


def _tokens(server, **kw) -> list[int]:
    body = {"prompt": "The ferry", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    r = _post(server, {**body, **kw})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def _healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_nan_temperature_fails_only_itself(server) -> None:
    body = '{"prompt": "x", "max_tokens": 2, "temperature": NaN}'
    with ThreadPoolExecutor(4) as pool:
        resps = list(pool.map(lambda _: _post(server, body), range(4)))
    for r in resps:
        assert "finite" in _bad(r, "temperature")
    for literal in ("Infinity", "-Infinity", "1e999"):
        _bad(_post(server, body.replace("NaN", literal)), "temperature")
    _healthy(server)
    assert len(_tokens(server, temperature=0.0)) == 6


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token(server) -> None:
    greedy = _tokens(server, temperature=0.0)
    assert _tokens(server, temperature=1e-40) == greedy
    assert _tokens(server, temperature=1.0, top_p=1e-300) == greedy
    _healthy(server)


def test_seed_outside_64_bits(server) -> None:
    for seed in (2**64, 10**30, -(2**63) - 1):
        assert "seed" in _bad(_post(server, {"prompt": "x", "max_tokens": 2, "seed": seed}), "seed")
    assert len(_tokens(server, temperature=1.0, seed=2**64 - 1)) == 6
    _healthy(server)


def test_lone_surrogates_are_not_text(server) -> None:
    msg = _bad(_post(server, '{"prompt": "a\\ud800b", "max_tokens": 2}'), "prompt")
    assert "surrogate" in msg
    chat = '{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}'
    assert "messages[0].content" in _bad(_post(server, chat, "/v1/chat/completions"), "messages")
    _bad(_post(server, '{"prompt": "x", "stop": ["\\ud83d"]}'), "stop")
    assert "UTF-8" in _bad(_post(server, b'{"prompt": "\xff"}'), None)
    _healthy(server)


def test_other_fields_out_of_range(server) -> None:
    cases = [
        ({"top_k": -5}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"stop": ["s"] * 65}, "stop"),
        ({"stop": ["s" * 1025]}, "stop"),
        ({"stop_token_ids": [2048]}, "stop_token_ids"),
        ({"prompt": [5, 2048]}, "prompt"),
        ({"prompt": [[5], []]}, "prompt"),
    ]
    for extra, param in cases:
        _bad(_post(server, {"prompt": "x", "max_tokens": 2, **extra}), param)
    assert len(_tokens(server, temperature=0.0, top_k=-1, stop=["s"] * 64)) <= 6


def test_max_tokens_beyond_the_context(server) -> None:
    msg = _bad(_post(server, {"prompt": "The ferry", "max_tokens": 600}), "max_tokens")
    assert "maximum context length is 512 tokens" in msg and "600" in msg
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 510}
    _bad(_post(server, chat, "/v1/chat/completions"), "max_tokens")
    # What fits is served (and without max_tokens the request may run to the context's end).
    r = _post(server, {"prompt": [5] * 500, "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


def test_malformed_json_says_what_is_wrong(server) -> None:
    msg = _bad(_post(server, '{"prompt": "x", "max_tokens": 2,'), None)
    assert msg.startswith("the request body is not valid JSON: ") and "line 1" in msg
    assert "must be a JSON object" in _bad(_post(server, "[1, 2]"), None)
    assert "nests" in _bad(_post(server, "[" * 100_000), None)
    assert _bad(_post(server, ""), None)


def _health_during(server, work) -> tuple[float, float, object]:
    """(seconds ``work()`` took, slowest /health meanwhile, its result)."""
    slowest, done = 0.0, threading.Event()

    def poll() -> None:
        nonlocal slowest
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get(server.url + "/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    try:
        result = work()
    finally:
        took = time.perf_counter() - t0
        done.set()
        poller.join()
    return took, slowest, result


def test_huge_prompts_are_refused_fast_and_stall_nobody(server) -> None:
    big = "lorem ipsum " * 850_000  # 10 MB
    for path, body, param in [
        ("/v1/completions", {"prompt": big, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
    ]:
        took, slowest, r = _health_during(server, lambda: _post(server, body, path))  # noqa: B023
        assert "characters" in _bad(r, param)
        assert took < 5.0 and slowest < 2.0, (took, slowest)
    many = {"prompt": ["x"] * 10_000, "max_tokens": 1}
    took, slowest, r = _health_during(server, lambda: _post(server, many))
    assert "at most 256 prompts" in _bad(r, "prompt")
    assert took < 5.0 and slowest < 2.0, (took, slowest)
    assert len(_tokens(server, temperature=0.0)) == 6
