"""Store mechanism units: chunk keys and namespaces, the value codec, Mooncake config."""

from __future__ import annotations

import json

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.stores.chunk_codec import HEADER_BYTES, ChunkCodec, CorruptValue
from kvferry.kv_transfer.stores.chunk_key import (
    ChunkLayout,
    chunk_key,
    key_digest,
    namespace_digest,
    store_namespace,
)
from kvferry.kv_transfer.stores.mooncake_config import load_mooncake_config

BASE = ChunkLayout("model-a", 4, 2, 64, torch.float32, 16, 2)


def test_namespace_is_stable_and_separates_models_dtypes_block_sizes():
    assert store_namespace(BASE) == store_namespace(ChunkLayout(**BASE.__dict__))
    variants = [
        ChunkLayout(**{**BASE.__dict__, "model_digest": "model-b"}),
        ChunkLayout(**{**BASE.__dict__, "dtype": torch.bfloat16}),
        ChunkLayout(**{**BASE.__dict__, "block_size": 32}),
        ChunkLayout(**{**BASE.__dict__, "blocks_per_chunk": 4}),
        ChunkLayout(**{**BASE.__dict__, "num_kv_heads": 4}),
        ChunkLayout(**{**BASE.__dict__, "world_size": 2}),
    ]
    names = {store_namespace(v) for v in variants} | {store_namespace(BASE)}
    assert len(names) == len(variants) + 1
    assert store_namespace(BASE, b"k" * 32) != store_namespace(BASE)
    h = bytes(range(32))
    key = chunk_key(store_namespace(BASE), h, 0)
    assert key.startswith("kvferry/") and key.endswith(f"{h.hex()}/r0")
    assert chunk_key(store_namespace(BASE), h, 1) != key


def _value(codec: ChunkCodec, key: str) -> torch.Tensor:
    value = torch.zeros(codec.value_bytes, dtype=torch.uint8)
    value[HEADER_BYTES:] = torch.randint(0, 255, (codec.payload_bytes,), dtype=torch.uint8)
    codec.seal(memoryview(value.numpy()), key_digest(key))
    return value


@pytest.mark.parametrize("secret", [None, b"s" * 32])
def test_codec_round_trip_and_detects_corruption(secret):
    codec = ChunkCodec(namespace_digest("ns"), 4096, secret)
    value = _value(codec, "k1")
    view = memoryview(value.numpy())
    codec.open(view, codec.value_bytes, key_digest("k1"))  # intact
    with pytest.raises(CorruptValue):
        codec.open(view, codec.value_bytes - 10, key_digest("k1"))  # short
    with pytest.raises(CorruptValue):
        codec.open(view, codec.value_bytes, key_digest("k2"))  # under another key
    with pytest.raises(CorruptValue):
        ChunkCodec(namespace_digest("other"), 4096, secret).open(
            view, codec.value_bytes, key_digest("k1")
        )
    value[HEADER_BYTES + 100] ^= 1
    with pytest.raises(CorruptValue):
        codec.open(view, codec.value_bytes, key_digest("k1"))
    if secret is not None:  # a CRC-sealed value is refused by a keyed reader
        plain = ChunkCodec(namespace_digest("ns"), 4096, None)
        with pytest.raises(CorruptValue):
            codec.open(memoryview(_value(plain, "k1").numpy()), codec.value_bytes,
                       key_digest("k1"))  # fmt: skip


def test_config_from_file_master_env_and_overrides(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "local_hostname": "10.0.0.1", "metadata_server": "http://m:8080/metadata",
        "master_server_address": "m:50051", "protocol": "RDMA", "device_name": "mlx5_0",
        "global_segment_size": "2GB", "local_buffer_size": 1024,
    }))  # fmt: skip
    cfg = load_mooncake_config(environ={"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.protocol == "rdma" and cfg.global_segment_size == 2 << 30
    assert cfg.local_buffer_size == 1024 and cfg.device_name == "mlx5_0"
    cfg = load_mooncake_config(
        {"protocol": "tcp", "global_segment_size": 0}, {"MOONCAKE_CONFIG_PATH": str(path)}
    )
    assert cfg.protocol == "tcp" and cfg.global_segment_size == 0
    assert cfg.master_server_address == "m:50051" and "extra_config" in cfg.source
    env = {"MOONCAKE_MASTER": "127.0.0.1:50051", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512mb"}
    cfg = load_mooncake_config(environ=env)
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.local_hostname == "localhost"
    assert cfg.global_segment_size == 512 << 20
    only = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
            "master_server_address": "h:1"}  # fmt: skip
    assert load_mooncake_config(only, environ={}).master_server_address == "h:1"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"local_hostname": "h"}), "missing required field"),
        (
            json.dumps(
                {"local_hostname": "h", "metadata_server": "x", "master_server_address": "no-port"}
            ),
            "host:port",
        ),  # fmt: skip
        (
            json.dumps(
                {
                    "local_hostname": "h",
                    "metadata_server": "x",
                    "master_server_address": "h:1",
                    "global_segment_size": "lots",
                }
            ),
            "not a size",
        ),  # fmt: skip
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_mooncake_config(environ={"MOONCAKE_CONFIG_PATH": str(path)})


def test_no_config_at_all_says_what_to_set():
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH"):
        load_mooncake_config(environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_mooncake_config(environ={"MOONCAKE_CONFIG_PATH": "/nonexistent/x.json"})
