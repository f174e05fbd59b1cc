"""A connector that fails and corrupts its loads (FaultInjectionConnector around the host
tier, ``kv_load_failure_policy = recompute``): every answer must still be the right one."""

from __future__ import annotations

from tests.helpers.servers import scrape

from .harness import Attack, Service, run_attack


def _injected(svc: Service) -> float:
    m = scrape(svc.url)
    return sum(v for k, v in m.items() if "stat=injected_" in k and "_total" in k)


def _host_hits(svc: Service) -> float:
    m = scrape(svc.url)
    return sum(v for k, v in m.items() if "hit_tokens_host" in k and "_total" in k)


def test_fault_injection(faulty, faulty_good) -> None:
    before = {"injected": _injected(faulty), "host_hits": _host_hits(faulty)}

    def attack(a: Attack) -> None:
        # The faults start at a fixed load index (see conftest); the attack is the good
        # client's own traffic from then on, so this only waits while it runs.
        for _ in a.rounds(pause=0.2, max_rounds=300):
            pass
        a.details["injected"] = _injected(faulty) - before["injected"]
        a.details["host_hit_tokens"] = _host_hits(faulty) - before["host_hits"]
        a.check(a.details["injected"] > 0, "no fault was injected: nothing was tested")

    r = run_attack(
        "fault_injection",
        "FaultInjectionConnector failing and corrupting every load (recompute policy)",
        attack,
        good=faulty_good,
        watch=[faulty],
    )
    assert not r.violations, r.summary()
