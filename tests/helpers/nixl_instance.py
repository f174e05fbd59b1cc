"""Drive ``nixl_harness.py`` engine processes from a test: one :class:`Instance` per process,
the NixlConnector config they run with, and the P/D calls the tests make on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).with_name("nixl_harness.py")
MAX_TOKENS = 12
LEASE_S = 4.0


class Instance:
    """A harness process: send commands, wait for their replies by id."""

    def __init__(self, name: str, model_dir: Path, kv: dict[str, Any], log: Path):
        self.name, self.log_path = name, log
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVFERRY_LOG_LEVEL": "INFO"}
        cmd = [sys.executable, str(HARNESS), str(model_dir), json.dumps(kv)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )
        self._replies: dict[str, dict[str, Any]] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._cv:
                self._replies[msg.get("id") or "ready"] = msg
                self._cv.notify_all()

    def wait(self, cid: str, timeout: float = 60.0) -> dict[str, Any]:
        with self._cv:
            if not self._cv.wait_for(
                lambda: cid in self._replies or self.proc.poll() is not None, timeout
            ):
                raise TimeoutError(f"{self.name}: no reply to {cid} in {timeout}s\n{self.log()}")
            if cid not in self._replies:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode})\n{self.log()}")
            return self._replies.pop(cid)

    def submit(self, op: str, **kw: Any) -> str:
        cid = uuid.uuid4().hex[:8]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": cid, **kw}) + "\n")
        self.proc.stdin.flush()
        return cid

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        return self.wait(self.submit(op, **kw), timeout)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.submit("exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def nixl_kv(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "side_channel_port": 0,
            "handshake_timeout": 1.5,
            "transfer_timeout": 10.0,
            "kv_lease_duration": LEASE_S,
            "heartbeat_interval": 0.5,
            **extra,
        },
    }


def submit_prefill(p: Instance, prompt: list[int]) -> str:
    return p.submit(
        "generate", prompt=prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )


def submit_decode(d: Instance, prompt: list[int], params: Any) -> str:
    return d.submit("generate", prompt=prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)


def assert_all_free(inst: Instance, within: float) -> float:
    st = inst.call("wait_idle", timeout=within + 30, within=within)
    assert st["idle"] and st["free_blocks"] == st["num_blocks"], (inst.name, st)
    return float(st["elapsed"])


def fake_params(prompt: list[int], engine_id: str, port: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_request_id": "r1",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": list(range(-(-len(prompt) // 16))),
        "remote_num_tokens": len(prompt),
        "tp_size": 1,
    }
