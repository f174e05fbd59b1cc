"""ExampleHiddenStatesConnector end to end on a tiny random model: every file holds, for the
chosen layers and every token it lists, the hidden states ``transformers`` computes
(``output_hidden_states=True``) on the same checkpoint; greedy outputs are token-identical
with and without the connector; batches, chunked prefill, prefix-cache hits, preemption and
generated tokens; bad configs are refused with a clear ConfigError; nothing leaks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.example_hidden_states import (
    cleanup_hidden_states,
    load_hidden_states,
)
from kvferry.kv_transfer.connectors.example_hidden_states.files import (
    safe_file_stem,
    take_write_lock,
)

transformers = pytest.importorskip("transformers")

NAME = "ExampleHiddenStatesConnector"
LAYERS = 4  # the tiny model's
LAYER_IDS = [0, 2, LAYERS]  # embeddings, a middle layer, the last layer's (pre-norm) output
ATOL = 1e-4


def _kv(folder: Path, **extra: Any) -> dict[str, Any]:
    config = {"shared_storage_path": str(folder), "eagle_aux_hidden_state_layer_ids": LAYER_IDS}
    config.update(extra)
    return {"kv_connector": NAME, "kv_role": "kv_producer", "kv_connector_extra_config": config}


def _llm(model_dir: Path, kv: dict[str, Any] | None, **kw: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64}
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _params(max_tokens: int = 6, **kv_params: Any) -> SamplingParams:
    extra = {"kv_transfer_params": kv_params} if kv_params else {}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _prompts(n: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]  # fmt: skip


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def drain_and_check(llm: LLM) -> None:
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not sched.requests
    assert sched.connector.num_tracked_requests() == 0  # type: ignore[union-attr]
    engine.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", layers=LAYERS)


class Reference:
    """transformers on the same checkpoint: each LAYER_IDS entry for every token of a
    sequence (id LAYERS read before the final norm, as vLLM defines it)."""

    def __init__(self, model_dir: Path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        )
        self._last: list[torch.Tensor] = []

        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            self._last.append(output[0] if isinstance(output, tuple) else output)

        self.model.model.layers[-1].register_forward_hook(keep)

    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        self._last.clear()
        with torch.no_grad():
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        rows = [self._last[0][0] if i == LAYERS else out.hidden_states[i][0] for i in LAYER_IDS]
        return torch.stack(rows, dim=1)  # [tokens, layers, hidden]


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


def _check_file(out: Any, expected_tokens: list[int], reference: Reference) -> None:
    path = out.kv_transfer_params["hidden_states_path"]
    data = load_hidden_states(path, timeout=30)
    assert data["token_ids"].tolist() == expected_tokens
    hs = data["hidden_states"]
    assert hs.shape == (len(expected_tokens), len(LAYER_IDS), 256)
    torch.testing.assert_close(hs, reference.hidden_states(expected_tokens), atol=ATOL, rtol=0)


def test_prompt_files_match_transformers_and_outputs_are_unchanged(
    model_dir, reference, tmp_path
) -> None:
    prompts = _prompts(5, [40, 17, 64, 3, 90])
    plain = _generate(_llm(model_dir, None), prompts, _params())
    llm = _llm(model_dir, _kv(tmp_path))
    outs = _generate(llm, prompts, _params())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for prompt, out in zip(prompts, outs, strict=True):
        _check_file(out, prompt, reference)
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if ".tmp-" in n]  # every write was renamed into place
    assert len([n for n in names if n.endswith(".safetensors")]) == len(prompts)
    drain_and_check(llm)


def test_chunked_prefill_and_generated_tokens(model_dir, reference, tmp_path) -> None:
    """Prompts split over several steps (32-token budget), files with the generated tokens."""
    prompts = _prompts(3, [75, 40, 33], seed=4)
    params = _params(max_tokens=7, include_output_tokens=True)
    plain = _generate(_llm(model_dir, None), prompts, params)
    llm = _llm(model_dir, _kv(tmp_path), max_num_batched_tokens=32)
    outs = _generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # The files of requests that finished in the last step are written by the next one.
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    for prompt, out in zip(prompts, outs, strict=True):
        generated = list(out.outputs[0].token_ids)
        assert len(generated) == 7
        _check_file(out, prompt + generated[:-1], reference)  # the last one was never fed
    drain_and_check(llm)


def test_prefix_cache_hit_reuses_the_hidden_states_of_its_blocks(
    model_dir, reference, tmp_path
) -> None:
    shared = _prompts(1, [64], seed=5)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    llm = _llm(model_dir, _kv(tmp_path))
    _check_file(_generate(llm, [first], _params())[0], first, reference)
    out = _generate(llm, [second], _params())[0]
    assert out.num_cached_tokens == 64  # four blocks not computed again
    _check_file(out, second, reference)
    drain_and_check(llm)


def test_preempted_requests_get_complete_files(model_dir, reference, tmp_path) -> None:
    """A pool too small for the batch: requests are preempted and recomputed."""
    prompts = _prompts(6, [50, 60, 45], seed=6)
    params = _params(max_tokens=40, include_output_tokens=True)
    kw = {"num_kv_blocks": 16, "max_model_len": 128}
    plain = _generate(_llm(model_dir, None, **kw), prompts, params)
    llm = _llm(model_dir, _kv(tmp_path), **kw)
    outs = _generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    for prompt, out in zip(prompts, outs, strict=True):
        _check_file(out, prompt + list(out.outputs[0].token_ids)[:-1], reference)
    drain_and_check(llm)


def test_request_aborted_before_its_prompt_ran_gets_no_file(model_dir, tmp_path) -> None:
    llm = _llm(model_dir, _kv(tmp_path))
    engine = llm.engine
    req_id = engine.add_request({"prompt_token_ids": list(range(10, 40))}, _params())
    engine.abort_request(req_id)
    outs = [o for _ in range(3) for o in engine.step()]
    assert all(not (o.kv_transfer_params or {}).get("hidden_states_path") for o in outs)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    drain_and_check(llm)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"shared_storage_pth": "x"}, "unknown kv_connector_extra_config option"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 5]}, "layer id 5 is out of range"),
        ({"eagle_aux_hidden_state_layer_ids": [-1]}, "layer id -1 is out of range"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 1]}, "distinct and increasing"),
        ({"eagle_aux_hidden_state_layer_ids": None}, "needs eagle_aux_hidden_state_layer_ids"),
        ({"num_writer_threads": 0}, "num_writer_threads must be at least 1"),
    ],
)
def test_bad_config_is_refused(model_dir, tmp_path, extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _llm(model_dir, _kv(tmp_path, **extra))


def test_unwritable_folder_is_refused(model_dir, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="is not a writable folder"):
        _llm(model_dir, _kv(blocker / "inside"))


def test_file_names_are_safe_and_distinct() -> None:
    assert safe_file_stem("cmpl-abc_1.2") == "cmpl-abc_1.2"
    odd = ["a/b", "a_b/", "../etc/passwd", "..", "", "é", "a b"]
    stems = [safe_file_stem(r) for r in odd]
    assert len(set(stems)) == len(odd)
    for stem in stems:
        assert stem and "/" not in stem and not stem.startswith(".")


def test_reader_waits_for_the_writer_lock(tmp_path) -> None:
    path = str(tmp_path / "r.safetensors")
    fd = take_write_lock(path)
    with pytest.raises(TimeoutError):
        load_hidden_states(path, timeout=0.1)
    os.close(fd)
    with pytest.raises(FileNotFoundError):  # lock released, no file was ever written
        load_hidden_states(path, timeout=1)
    cleanup_hidden_states(path)
    assert not os.listdir(tmp_path)


def test_conformance_kit_drives_it_through_misses(tmp_path) -> None:
    """Store-only: the kit's miss and save scenarios pass; it never offers a hit, so every hit
    scenario is not exercised (and none fails)."""
    from kvferry.testing import NOT_EXERCISED, PASSED, builtin_configs, run_conformance

    report = run_conformance(builtin_configs(tmp_path)[NAME], profile="quick")
    status = {r.scenario: r.status for r in report.results}
    assert report.ok, report.to_text()
    assert status["miss"] == PASSED and status["preemption during a save"] == PASSED
    assert status["sync hit"] == status["full hit"] == NOT_EXERCISED
