"""Block hashes: canonical encoding, chaining, cache_salt, stability across processes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvferry.core.block_hash import (
    NONE_HASH,
    get_request_block_hasher,
    hash_block_tokens,
    hash_token_blocks,
)
from tests.helpers.scheduler import create_request

# Pinned outputs. If these change, every persisted or shared cache key changes with them:
# bump the encoding's domain tag on purpose, never by accident.
GOLDEN_NONE_HASH = "5d272f464854b9800c01bacaed88c4f38379e6cd68c12362cd2d051d8d0fd7b7"
GOLDEN_BLOCK_0_15 = "3b995638a249699d7258bdef562553f1ed0358a8fffb6afb87abff0d28656c37"
GOLDEN_SALTED = [
    "7bcbef25fa90a79af8bd4987a541363782f8a44a98127a8237249d76d7e9a7a6",
    "8f8a366af65632028ace0d1ddd451c7cd8e6007318a8911768e98288825173ab",
]


def test_golden_values() -> None:
    assert NONE_HASH.hex() == GOLDEN_NONE_HASH
    assert hash_block_tokens(None, list(range(16))).hex() == GOLDEN_BLOCK_0_15
    hashes = hash_token_blocks(list(range(40)), 16, cache_salt="salt")
    assert [h.hex() for h in hashes] == GOLDEN_SALTED


def test_encoding_matches_documented_format() -> None:
    # An independent re-implementation of the format in block_hash's module docstring.
    def ref(parent: bytes, tokens: list[int], keys: list[tuple[bytes, bytes]]) -> bytes:
        data = b"kvferry-block-v1\x00" + parent + struct.pack(">I", len(tokens))
        data += b"".join(struct.pack(">Q", t) for t in tokens)
        data += struct.pack(">I", len(keys))
        data += b"".join(tag + struct.pack(">I", len(p)) + p for tag, p in keys)
        return hashlib.sha256(data).digest()

    assert hashlib.sha256(b"kvferry-none-hash").digest() == NONE_HASH
    assert hash_block_tokens(None, [1, 2, 3]) == ref(NONE_HASH, [1, 2, 3], [])
    parent = hashlib.sha256(b"x").digest()
    got = hash_block_tokens(parent, [5, 2**63], ["cache_salt", -1, b"\x00"])
    want = ref(
        parent,
        [5, 2**63],
        [(b"s", b"cache_salt"), (b"i", struct.pack(">q", -1)), (b"b", b"\x00")],
    )
    assert got == want


def test_same_hashes_in_another_process() -> None:
    code = (
        "from kvferry.core.block_hash import hash_token_blocks\n"
        "print(','.join(h.hex() for h in hash_token_blocks(list(range(50)), 16, 'salt')))\n"
    )
    here = ",".join(h.hex() for h in hash_token_blocks(list(range(50)), 16, "salt"))
    # A pinned str-hash seed that differs from this process's (random) one: Python's hash()
    # must play no part.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == here


def test_chaining() -> None:
    tokens = list(range(64))
    base = hash_token_blocks(tokens, 16)
    assert len(base) == 4 and len(set(base)) == 4
    # Changing a token in block 1 changes block 1 and every later hash, never earlier ones.
    changed = hash_token_blocks(tokens[:20] + [999] + tokens[21:], 16)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:], strict=True))
    # Same tokens under a different parent hash differ.
    assert hash_block_tokens(base[0], tokens[:16]) != hash_block_tokens(None, tokens[:16])


def test_only_full_blocks_hashed() -> None:
    assert hash_token_blocks(list(range(15)), 16) == []
    assert len(hash_token_blocks(list(range(47)), 16)) == 2
    assert len(hash_token_blocks(list(range(48)), 16)) == 3


def test_no_ambiguous_encodings() -> None:
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [258])
    assert hash_block_tokens(None, [1], ["1"]) != hash_block_tokens(None, [1], [1])
    assert hash_block_tokens(None, [1], ["ab", "c"]) != hash_block_tokens(None, [1], ["a", "bc"])
    assert hash_block_tokens(None, [1], []) == hash_block_tokens(None, [1], None)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        hash_block_tokens(None, [-1])
    with pytest.raises(ValueError):
        hash_block_tokens(None, [2**64])
    with pytest.raises(ValueError):
        hash_block_tokens(b"short", [1])
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], [True])
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], [1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        get_request_block_hasher(0)


def test_cache_salt_only_in_first_block() -> None:
    tokens = list(range(48))
    plain = hash_token_blocks(tokens, 16)
    salted = hash_token_blocks(tokens, 16, cache_salt="tenant-a")
    other = hash_token_blocks(tokens, 16, cache_salt="tenant-b")
    assert salted[0] == hash_block_tokens(None, tokens[:16], ["cache_salt", "tenant-a"])
    # Later blocks carry no salt key of their own; the salt reaches them through the chain.
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32])
    assert salted[2] == hash_block_tokens(salted[1], tokens[32:48])
    assert len({plain[i] for i in range(3)} & set(salted)) == 0
    assert len(set(salted) & set(other)) == 0


def test_request_hashes_grow_incrementally() -> None:
    req = create_request(prompt_token_ids=list(range(30)), cache_salt="s")
    assert req.block_hashes == hash_token_blocks(list(range(30)), 16, cache_salt="s")
    assert len(req.block_hashes) == 1
    for t in range(30, 70):
        req.append_output_token_ids([t])
        assert len(req.block_hashes) == (t + 1) // 16
    assert req.block_hashes == hash_token_blocks(list(range(70)), 16, cache_salt="s")


def test_hasher_matches_block_size() -> None:
    req = create_request(prompt_token_ids=list(range(32)), block_size=8)
    assert req.block_hashes == hash_token_blocks(list(range(32)), 8)
    assert len(req.block_hashes) == 4
