"""kvferry's KV event stream against vLLM's own classes (``vllm/distributed/kv_events.py`` from
the published wheel): payloads decode both ways field by field, frames and replay answers are
byte-identical to vLLM's publisher's, and a subscriber written like vLLM's example reads
kvferry's publisher over TCP. The view a vLLM-style connector sees is the engine's own."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

import kvferry.kv_events as kv
from kvferry.config import KVEventsConfig
from kvferry.kv_events import ZmqEventPublisher, decode_batch, encode_batch
from tests.kv_events import vllm_events
from tests.kv_events.zmq_helpers import END_SEQ, dealer, replay, subscribe


@pytest.fixture(scope="module")
def vllm() -> Any:
    return vllm_events.load()


def kvferry_batch() -> kv.KVEventBatch:
    h = kv.external_block_hash
    full = kv.BlockStored(
        block_hashes=[h(b"\x01" * 32), h(b"\x02" * 32)],
        parent_block_hash=h(b"\x00" * 32),
        token_ids=list(range(32)),
        block_size=16,
        lora_id=3,
        medium=kv.MEDIUM_CPU,
        lora_name="adapter",
        extra_keys=[("adapter", "salt"), None],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="host-tier",
        session_id="s-1",
    )
    plain = kv.BlockStored([b"\xaa" * 32], None, [1, 2, 3, 4], 4, None, kv.MEDIUM_GPU, None)
    return kv.KVEventBatch(
        ts=1234.5,
        events=[
            full,
            plain,
            kv.BlockRemoved([h(b"\x01" * 32)], kv.MEDIUM_STORAGE, group_idx=2, locality="REMOTE"),
            kv.BlockRemoved([7], None),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )


def to_vllm(vllm: Any, batch: kv.KVEventBatch) -> Any:
    """The same batch built from vLLM's classes (field by field, by name)."""
    events = [
        getattr(vllm, type(e).__name__)(**{f: getattr(e, f) for f in e.__struct_fields__})
        for e in batch.events
    ]
    return vllm.KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=2)


def assert_same(ours: Any, theirs: Any) -> None:
    assert type(ours).__name__ == type(theirs).__name__
    assert ours.__struct_fields__ == theirs.__struct_fields__
    for name in theirs.__struct_fields__:
        a, b = getattr(ours, name), getattr(theirs, name)
        if name == "events":
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                assert_same(x, y)
        else:
            assert a == b and type(a) is type(b), (name, a, b)


def test_struct_schemas_match_vllm(vllm: Any) -> None:
    for name in ("EventBatch", "KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"):
        ours, theirs = getattr(kv, name), getattr(vllm, name)
        assert ours.__struct_fields__ == theirs.__struct_fields__, name
        assert ours.__struct_defaults__ == theirs.__struct_defaults__, name
        for opt in ("array_like", "omit_defaults", "tag", "tag_field"):
            assert getattr(ours.__struct_config__, opt) == getattr(theirs.__struct_config__, opt), (
                name,
                opt,
            )
    assert (kv.MEDIUM_GPU, kv.MEDIUM_CPU, kv.MEDIUM_STORAGE) == (
        vllm.MEDIUM_GPU,
        vllm.MEDIUM_CPU,
        vllm.MEDIUM_STORAGE,
    )
    assert ZmqEventPublisher.END_SEQ == vllm.ZmqEventPublisher.END_SEQ


def test_kvferry_payload_decodes_with_vllm_classes(vllm: Any) -> None:
    ours = kvferry_batch()
    payload = encode_batch(ours)
    theirs = msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(payload)
    assert_same(ours, theirs)
    # Byte for byte what vLLM's publisher encodes for the same batch.
    assert msgspec.msgpack.Encoder().encode(to_vllm(vllm, ours)) == payload


def test_vllm_payload_decodes_with_kvferry(vllm: Any) -> None:
    theirs = to_vllm(vllm, kvferry_batch())
    payload = msgspec.msgpack.Encoder().encode(theirs)
    assert_same(decode_batch(payload), theirs)


def test_vllm_aggregator_agrees_on_common_events(vllm: Any) -> None:
    batch = kvferry_batch()
    for cls in (kv.KVEventAggregator, vllm.KVEventAggregator):
        agg = cls(3)
        agg.add_events(list(batch.events))
        agg.add_events(list(batch.events[:3]))
        agg.add_events(list(batch.events[1:4]))
        assert agg.get_common_events() == batch.events[1:3], cls


def frames_of(pub: Any, endpoint: str, topic: str, batches: list[Any]) -> list[list[bytes]]:
    sub, warm = subscribe(endpoint, topic, lambda b: pub.publish(b))
    for b in batches:
        pub.publish(b)
    out: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while len(out) < len(batches) and time.monotonic() < deadline:
        if sub.poll(50):
            frames = sub.recv_multipart()
            if decode_batch(frames[2]).ts >= 0:
                out.append(frames)
    sub.close(0)
    # Renumber from 0: the two publishers sent different numbers of warm-up markers.
    return [[f[0], (int.from_bytes(f[1], "big") - warm).to_bytes(8, "big"), f[2]] for f in out]


def test_frames_and_replay_match_vllm_publisher(vllm: Any) -> None:
    sent = [kvferry_batch()]
    # The batches carry their rank; vLLM would rename inproc endpoints for a rank other than 0.
    theirs_pub = vllm.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="inproc://vllm-kv-events",
        replay_endpoint="inproc://vllm-kv-replay",
        topic="kv",
    )
    ours_pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        topic="kv",
    )
    try:
        theirs = frames_of(theirs_pub, "inproc://vllm-kv-events", "kv", [to_vllm(vllm, sent[0])])
        ours = frames_of(ours_pub, ours_pub.get_publisher_config().endpoint, "kv", sent)
        assert ours == theirs and len(ours) == 1
        # Replay answers: the same frames per batch and the same end marker.
        a = dealer("inproc://vllm-kv-replay")
        b = dealer(ours_pub.get_publisher_config().replay_endpoint or "")
        from_theirs = replay(a, (0).to_bytes(8, "big"))
        from_ours = replay(b, (0).to_bytes(8, "big"))
        assert from_theirs[-1] == from_ours[-1] == [b"", END_SEQ, b""]
        assert from_theirs[-2][0] == from_ours[-2][0] == b"kv"
        assert from_theirs[-2][2] == from_ours[-2][2]  # the last batch's payload
        a.close(0)
        b.close(0)
    finally:
        theirs_pub.shutdown()
        ours_pub.shutdown()


def test_example_style_subscriber_reads_kvferry_over_tcp(vllm: Any) -> None:
    """SUB for the live stream, DEALER for replay, as vLLM's example subscriber: batches
    published before it connected are fetched by replay on the first gap."""
    pub = ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv-events"
    )
    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    try:
        for n in range(10):
            pub.publish(kv.KVEventBatch(ts=float(n), events=[kv.BlockRemoved([n], "GPU")]))
        cfg = pub.get_publisher_config()
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.connect(cfg.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        replay_sock = ctx.socket(zmq.DEALER)
        replay_sock.connect(cfg.replay_endpoint or "")
        seen: dict[int, Any] = {}
        last_seq, n = -1, 10
        deadline = time.monotonic() + 20
        while len(seen) < 15 and time.monotonic() < deadline:
            if n < 200:
                pub.publish(kv.KVEventBatch(ts=float(n), events=[kv.BlockRemoved([n], "GPU")]))
                n += 1
            if not sub.poll(50):
                continue
            _, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > last_seq + 1:
                replay_sock.send_multipart([b"", (last_seq + 1).to_bytes(8, "big")])
                while replay_sock.poll(2000):
                    _, _, rseq_bytes, rpayload = replay_sock.recv_multipart()
                    if not rpayload:
                        break  # end of replay
                    rseq = int.from_bytes(rseq_bytes, "big")
                    if last_seq < rseq < seq:
                        seen[rseq] = decoder.decode(rpayload)
                        last_seq = rseq
            seen[seq] = decoder.decode(payload)
            last_seq = seq
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= 15
        for seq, batch in seen.items():
            assert batch.ts == float(seq) and batch.events[0].block_hashes == [seq]
            assert batch.data_parallel_rank == 0
        sub.close(0)
        replay_sock.close(0)
    finally:
        pub.shutdown()


def test_vllm_style_connector_sees_the_engines_types_and_config() -> None:
    from kvferry.kv_transfer import vllm_imports

    assert vllm_imports.install()
    from vllm.config import KVEventsConfig as VllmKVEventsConfig
    from vllm.config import VllmConfig
    from vllm.distributed import kv_events as vllm_kv_events

    for name in (
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "KVEventBatch",
        "KVConnectorKVEvents",
        "KVEventAggregator",
        "EventPublisherFactory",
        "ZmqEventPublisher",
    ):
        assert getattr(vllm_kv_events, name) is getattr(kv, name), name
    assert VllmKVEventsConfig is KVEventsConfig
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, topic="t")
    engine_cfg = SimpleNamespace(
        model_config=None,
        cache_config=None,
        parallel_config=None,
        scheduler_config=SimpleNamespace(),
        device_config=None,
        kv_transfer_config=None,
        kv_events_config=events_cfg,
    )
    engine_cfg.model_config = SimpleNamespace(max_len=64)
    view = VllmConfig(engine_cfg)  # type: ignore[arg-type]
    assert view.kv_events_config is events_cfg and view.kv_events_config.publishes
