"""Offload mechanism: host and disk tiers, transfer jobs, eviction policies (no connector API)."""
