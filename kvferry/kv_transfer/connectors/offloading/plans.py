"""A step's planned transfers, chunk by chunk, before they are packed into jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.offload.policies import Key


@dataclass
class ChunkTransfer:
    """One chunk of a load or a store: its key, its engine blocks, and the host slot and
    host blocks they pair with. A load straight from the chunk's file has no slot; it reads
    the file's blocks from ``first_block`` on."""

    key: Key
    engine_blocks: list[int]
    slot: int | None
    host_blocks: list[int] = field(default_factory=list)
    first_block: int = 0


@dataclass
class RequestTransfer:
    """One request's share of a step's load or store (``req_id`` "" when it serves the
    engine rather than a request). Stores also list the chunks written to disk from their
    host slot once the store is done (``write_through``), and those written from the engine
    blocks straight to disk because the host had no room (``disk_only``)."""

    req_id: str
    chunks: list[ChunkTransfer] = field(default_factory=list)
    write_through: list[tuple[Key, int]] = field(default_factory=list)
    disk_only: list[tuple[Key, list[int]]] = field(default_factory=list)

    @staticmethod
    def merged(parts: list[RequestTransfer]) -> RequestTransfer:
        """All parts as one transfer, in order."""
        merged = RequestTransfer("")
        for part in parts:
            merged.chunks += part.chunks
            merged.write_through += part.write_through
            merged.disk_only += part.disk_only
        return merged

    @property
    def keys(self) -> list[Key]:
        return [c.key for c in self.chunks]

    @property
    def slots(self) -> list[int | None]:
        return [c.slot for c in self.chunks]

    def host_copies(self) -> tuple[list[int], list[int]]:
        """The engine blocks and host blocks of every chunk with a host slot, pair by pair."""
        engine: list[int] = []
        host: list[int] = []
        for chunk in self.chunks:
            if chunk.slot is not None:
                engine += chunk.engine_blocks
                host += chunk.host_blocks
        return engine, host

    def file_loads(self) -> list[tuple[str, int, list[int]]]:
        """``(key hex, first block in the file, engine blocks)`` of chunks read from files."""
        return [
            (c.key.hex(), c.first_block, c.engine_blocks) for c in self.chunks if c.slot is None
        ]
