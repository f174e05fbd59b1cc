"""Stop conditions in the scheduler (no model): EOS, ``ignore_eos``, ``min_tokens``, stop token
ids, ``max_tokens``, ``max_model_len``, and tokens sampled after a stop.

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

from kvferry.step_types.runner_output import ModelRunnerOutput
from tests.helpers.scheduler import (
    EOS_TOKEN,
    assert_no_leaks,
    create_request,
    create_scheduler,
    run_until_done,
)

# -- stop conditions ----------------------------------------------------------------------


def _run_one(token, max_model_len: int = 256, num_tokens: int = 10, **kwargs):  # type: ignore[no-untyped-def]
    s = create_scheduler(max_model_len=max_model_len)
    r = create_request(num_tokens, **kwargs)
    s.add_request(r)
    res = run_until_done(s, token=token)
    assert_no_leaks(s)
    return (
        res.tokens[r.request_id],
        res.finish_reasons[r.request_id],
        res.stop_reasons[r.request_id],
    )


def test_stop_on_eos() -> None:
    toks, reason, stop = _run_one(lambda rid, i: EOS_TOKEN if i == 2 else 7)
    assert (toks, reason, stop) == ([7, 7, EOS_TOKEN], "stop", None)


def test_ignore_eos() -> None:
    toks, reason, _ = _run_one(EOS_TOKEN, ignore_eos=True, max_tokens=5)
    assert (toks, reason) == ([EOS_TOKEN] * 5, "length")


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    toks, reason, _ = _run_one(EOS_TOKEN, min_tokens=3)
    assert (toks, reason) == ([EOS_TOKEN] * 3, "stop")
    toks, reason, stop = _run_one(42, min_tokens=2, stop_token_ids=[42])
    assert (toks, reason, stop) == ([42, 42], "stop", 42)


def test_stop_token_ids() -> None:
    toks, reason, stop = _run_one(lambda rid, i: 42 if i == 1 else 7, stop_token_ids=[42])
    assert (toks, reason, stop) == ([7, 42], "stop", 42)


def test_max_tokens() -> None:
    assert _run_one(7, max_tokens=4)[:2] == ([7] * 4, "length")


def test_max_model_len_caps_output() -> None:
    toks, reason, _ = _run_one(7, max_model_len=32, num_tokens=30, max_tokens=None)
    assert (toks, reason) == ([7, 7], "length")
    # A prompt of exactly max_model_len still yields one token.
    toks, reason, _ = _run_one(7, max_model_len=32, num_tokens=32, max_tokens=None)
    assert (toks, reason) == ([7], "length")


def test_tokens_after_a_stop_are_dropped() -> None:
    s = create_scheduler()
    r = create_request(10)
    s.add_request(r)
    so = s.schedule()
    ro = ModelRunnerOutput(req_ids=[r.request_id], sampled_token_ids=[[7, EOS_TOKEN, 7]])
    (out,) = s.update_from_output(so, ro)
    assert out.new_token_ids == [7, EOS_TOKEN] and out.finish_reason == "stop"
    assert_no_leaks(s)
