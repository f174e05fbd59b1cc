"""Prefix caching seen from the scheduler (no model): hits between requests, the recomputed
last token of a full hit, cache salts, and caching turned off.

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

import pytest

from tests.helpers.scheduler import (
    SAMPLED_TOKEN,
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    run_until_done,
    step,
)

# -- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_between_requests() -> None:
    s = create_scheduler()
    worker = FakeWorker(s)
    a = create_request(prompt_token_ids=list(range(40)), max_tokens=4)
    s.add_request(a)
    so_a, _ = step(s, worker)
    b = create_request(prompt_token_ids=list(range(32)) + [9999] * 8, max_tokens=4)
    s.add_request(b)
    so, outs = step(s, worker)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens[b.request_id] == 8
    assert new.block_ids[0][:2] == so_a.scheduled_new_reqs[0].block_ids[0][:2]
    assert b.prefill_stats is not None and b.prefill_stats.num_local_cached_tokens == 32
    out_b = next(o for o in outs if o.request_id == b.request_id)
    assert out_b.num_local_cached_tokens == 32 and out_b.num_external_cached_tokens == 0
    stats = s.make_stats()
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)
    res = run_until_done(s, worker)
    assert len(res.tokens[b.request_id]) == 3
    assert_no_leaks(s)


@pytest.mark.parametrize(("length", "expect_hit"), [(32, 16), (33, 32), (48, 32)])
def test_full_hit_recomputes_last_token(length: int, expect_hit: int) -> None:
    s = create_scheduler()
    s.add_request(create_request(prompt_token_ids=list(range(48)), max_tokens=2))
    run_until_done(s)
    b = create_request(prompt_token_ids=list(range(length)), max_tokens=2)
    s.add_request(b)
    so, outs = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == expect_hit
    assert so.num_scheduled_tokens[b.request_id] == length - expect_hit
    assert outs[0].new_token_ids == [SAMPLED_TOKEN]  # the recomputed tail produced logits
    run_until_done(s)
    assert_no_leaks(s)


def test_cache_salt_isolates_prefixes() -> None:
    s = create_scheduler()
    prompt = list(range(40))
    s.add_request(create_request(prompt_token_ids=prompt, cache_salt="x", max_tokens=1))
    run_until_done(s)
    hits = {}
    for salt in ("y", None, "x"):
        r = create_request(prompt_token_ids=prompt, cache_salt=salt, max_tokens=1)
        s.add_request(r)
        step(s)
        assert r.prefill_stats is not None
        hits[salt] = r.prefill_stats.num_local_cached_tokens
    assert hits == {"y": 0, None: 0, "x": 32}
    assert_no_leaks(s)


def test_prefix_caching_disabled() -> None:
    s = create_scheduler(enable_prefix_caching=False)
    for _ in range(2):
        r = create_request(prompt_token_ids=list(range(40)), max_tokens=2)
        s.add_request(r)
        run_until_done(s)
        assert r.prefill_stats is not None and r.prefill_stats.num_local_cached_tokens == 0
    assert_no_leaks(s)
