"""Bad input gets one clear error message (ConfigError / exit code 2), never a deep traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_malformed_config(tmp_path: Path, tiny_model_factory) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_factory("llama"), bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(model=str(bad))


def test_missing_weights(tmp_path: Path, tiny_model_factory) -> None:
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_model_factory("llama"), bad)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        LLM(model=str(bad))


def test_unsupported_architecture(tmp_path: Path, tiny_model_factory) -> None:
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_model_factory("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        LLM(model=str(bad))


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(model=str(tiny_model_factory("llama")), dtype="float32", max_model_len=64)


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="max_model_len=64"):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    assert llm.engine.scheduler.get_num_unfinished_requests() == 0


def test_bad_token_ids_and_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, use_tqdm=False)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_a_bad_prompt_does_not_leave_others_behind(llm: LLM) -> None:
    with pytest.raises(ConfigError):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 100}], use_tqdm=False
        )
    assert llm.engine.scheduler.get_num_unfinished_requests() == 0
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 100}, "logprobs"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_memory": "1KiB"}, "fewer than"),
        ({"num_kv_blocks": 2}, "cannot hold one request"),
        ({"kv_cache_memory": "100TiB"}, "available"),
        ({"kv_cache_memory": "lots"}, "cannot parse size"),
        ({"block_size": 3}, "power of two"),
        ({"max_model_len": 10**7}, "max_position_embeddings"),
        ({"dtype": "int4"}, "dtype"),
        ({"bogus_flag": 1}, "unknown engine argument"),
    ],
)
def test_impossible_engine_settings(tiny_model_factory, kwargs: dict, match: str) -> None:
    base = {"max_model_len": 256}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(tiny_model_factory("llama")), **base)


def test_cli_reports_errors_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "generate",
            "--model",
            str(tmp_path / "x"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: model folder")
    assert "Traceback" not in proc.stderr
