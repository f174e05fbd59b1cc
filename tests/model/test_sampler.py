from __future__ import annotations

import torch

from kvferry.model.sampler import Sampler, SamplingRow
from kvferry.sampling_params import SamplingParams


def _sampler() -> Sampler:
    return Sampler(torch.Generator().manual_seed(0))


def test_greedy_takes_argmax_and_reports_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=1), None),
        SamplingRow(SamplingParams(temperature=0), None),
    ]
    out = _sampler()(logits, rows)
    assert out.token_ids == [1, 0]
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    assert lp is not None and set(lp) == {1}
    assert abs(lp[1] - torch.log_softmax(logits[0], -1)[1].item()) < 1e-6


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=1), None) for _ in range(4)]
    assert _sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), None)]
    s = _sampler()
    assert {s(logits, rows).token_ids[0] for _ in range(50)} == {0}
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.85), None)]
    assert {s(logits, rows).token_ids[0] for _ in range(200)} == {0, 1}


def test_seeded_rows_are_reproducible() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [
        _sampler()(logits, [SamplingRow(p, torch.Generator().manual_seed(42))]).token_ids[0]
        for _ in range(3)
    ]
    assert len(set(a)) == 1
