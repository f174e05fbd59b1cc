"""Offload eviction policies: LRU and ARC eviction, pins, and policies chosen by name or
by module path."""

from __future__ import annotations

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.offload.policies import ARCPolicy, EvictionPolicy, LRUPolicy, policy_class
from tests.helpers.offload_keys import k

# -- policies -----------------------------------------------------------------------------


def test_lru_evicts_oldest_and_is_atomic() -> None:
    p = LRUPolicy(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    assert p.evict(2, lambda key: True) == [k(1), k(2)]
    assert p.evict(3, lambda key: key != k(3)) is None  # only k(0) evictable: no change
    assert set(p.keys()) == {k(0), k(3)}


def test_arc_keeps_reused_keys_against_a_scan() -> None:
    p = ARCPolicy(4)
    for i in (0, 1):
        p.insert(k(i))
        p.touch(k(i))  # reused: T2
    victims = []
    for i in range(10, 20):  # a scan of one-off keys
        if len(p) == 4:
            victims += p.evict(1, lambda key: True) or []
        p.insert(k(i))
    assert k(0) in p and k(1) in p, "the scan flushed the reused keys"
    assert k(0) not in victims and k(1) not in victims
    # A ghost hit in B1 grows T1's target.
    before = p.target_t1
    ghost = next(iter(p.b1))
    p.evict(1, lambda key: True)
    p.insert(ghost)
    assert p.target_t1 > before and ghost in p.t2


def test_arc_evict_is_atomic_and_respects_pins() -> None:
    p = ARCPolicy(3)
    for i in range(3):
        p.insert(k(i))
    assert p.evict(2, lambda key: key == k(1)) is None
    assert len(p) == 3
    assert p.evict(1, lambda key: key == k(1)) == [k(1)]


class _FifoPolicy(LRUPolicy):
    """A custom policy loaded by module path in a test."""


def test_policy_by_name_and_module_path() -> None:
    assert policy_class("lru") is LRUPolicy and policy_class("arc") is ARCPolicy
    assert policy_class(f"{__name__}:_FifoPolicy") is _FifoPolicy
    assert issubclass(
        policy_class("kvferry.kv_transfer.offload.policies.lru.LRUPolicy"), EvictionPolicy
    )
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        policy_class("mru")
    with pytest.raises(ConfigError, match="cannot import"):
        policy_class("no_such_module:Policy")
    with pytest.raises(ConfigError, match="not an EvictionPolicy"):
        policy_class("collections:OrderedDict")
