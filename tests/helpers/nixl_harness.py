"""One kvferry engine in its own process, driven by JSON lines on stdin (for the NIXL tests).

Usage: ``python tests/helpers/nixl_harness.py MODEL_DIR KV_TRANSFER_CONFIG_JSON``

Prints ``{"ready": true, ...}`` once the engine is up, then answers each command with one JSON
line carrying the command's ``id``. The engine steps whenever it has work, between commands:

* ``{"op": "generate", "id", "prompt": [...], "max_tokens", "kv_transfer_params"}``: answered
  when the request finishes (tokens, finish_reason, error, kv_transfer_params, cached counts);
* ``{"op": "status", "id"}``: free and total blocks, whether the engine still has work;
* ``{"op": "wait_idle", "id", "within"}``: answered once the engine has no work left (every
  held block returned), or at the timeout;
* ``{"op": "release", "id", "kv_transfer_params"}``: the server's release path (a one-token
  request aborted as soon as it is added);
* ``{"op": "slow_post", "id", "engine_id", "delay"}``: wait ``delay`` s before posting each
  READ from that engine;
* ``{"op": "die_after_claim", "id"}``: from now on, this process kills itself (SIGKILL)
  right after it grants a reader's claim, i.e. in the middle of that reader's transfer;
* ``{"op": "try_release", "id", "kv_transfer_params"}``: as ``release``, but params refused at
  intake are answered with ``error`` instead of ending the harness;
* ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from typing import Any


def _die_after_claim() -> None:
    from kvferry.kv_transfer.connectors.pd import lease

    original = lease.LeaseTable.claim

    def claim(self: Any, req: Any, *args: Any) -> Any:
        reply = original(self, req, *args)
        if type(reply).__name__ == "Granted":  # die once the reply is on its way
            kill = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL))
            kill.daemon = True
            kill.start()
        return reply

    lease.LeaseTable.claim = claim  # type: ignore[method-assign]


def _slow_posts(engine_id: str, delay: float) -> None:
    from kvferry.kv_transfer.connectors.pd import reader

    original = reader.Reader._post

    def post(self: Any, rd: Any, leg: Any, info: Any) -> None:
        if info.engine_id == engine_id:
            time.sleep(delay)
        original(self, rd, leg, info)

    reader.Reader._post = post  # type: ignore[method-assign]


def main() -> None:
    # Replies get stdout to themselves; anything else printing there (NIXL, UCX) goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    model, kv_json = sys.argv[1], sys.argv[2]
    from kvferry import LLM, SamplingParams
    from kvferry.config import ConfigError

    kvt = json.loads(kv_json)
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=4096,
        num_kv_blocks=512,
        kv_transfer_config=kvt,
    )
    engine = llm.engine
    sched = engine.scheduler
    worker = engine.executor.worker.kv_connector
    out_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        with out_lock:
            replies.write(json.dumps(msg) + "\n")
            replies.flush()

    def status() -> dict[str, Any]:
        return {
            "free_blocks": sched.kv_cache_manager.get_num_free_blocks(),
            "num_blocks": engine.kv_cache_config.num_blocks,
            "busy": engine.has_unfinished_requests(),
            "requests": sorted(sched.requests),
        }

    commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put({"op": "exit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    nixl = getattr(worker, "connector_worker", None)
    send(
        {
            "ready": True,
            "engine_id": kvt.get("engine_id") or engine.config.kv_transfer_config.engine_id,
            "port": nixl.port if nixl is not None else None,
            "compat": nixl.codec.compat.desc if nixl is not None else None,
        }
    )
    pending: dict[str, str] = {}  # engine request id -> command id
    idle_waits: list[tuple[str, float, float]] = []  # (command id, started, deadline)
    while True:
        try:
            cmd = commands.get(timeout=0.002 if engine.has_unfinished_requests() else 0.05)
        except queue.Empty:
            cmd = None
        if cmd is not None:
            op, cid = cmd["op"], cmd.get("id")
            if op == "exit":
                break
            if op == "generate":
                extra = {}
                if cmd.get("kv_transfer_params") is not None:
                    extra["kv_transfer_params"] = cmd["kv_transfer_params"]
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=cmd["max_tokens"],
                    ignore_eos=True,
                    extra_args=extra,
                )
                try:
                    rid = engine.add_request({"prompt_token_ids": cmd["prompt"]}, sp)
                except ConfigError as e:  # refused at intake (e.g. malformed kv_transfer_params)
                    send({"id": cid, "finish_reason": "rejected", "error": str(e), "tokens": []})
                    continue
                pending[rid] = cid
            elif op == "status":
                send({"id": cid, **status()})
            elif op == "wait_idle":
                now = time.monotonic()
                idle_waits.append((cid, now, now + cmd["within"]))
            elif op == "release":
                sp = SamplingParams(
                    max_tokens=1, extra_args={"kv_transfer_params": cmd["kv_transfer_params"]}
                )
                rid = f"kv-release-{cid}"
                engine.add_request([0], sp, rid)
                engine.abort_request(rid)
                send({"id": cid, "released": rid})
            elif op == "die_after_claim":
                _die_after_claim()
                send({"id": cid})
            elif op == "slow_post":
                _slow_posts(cmd["engine_id"], cmd["delay"])
                send({"id": cid})
            elif op == "try_release":  # like "release", but params refused at intake are answered
                sp = SamplingParams(
                    max_tokens=1, extra_args={"kv_transfer_params": cmd["kv_transfer_params"]}
                )
                rid = f"kv-release-{cid}"
                try:
                    engine.add_request([0], sp, rid)
                except ConfigError as e:
                    send({"id": cid, "error": str(e)})
                    continue
                engine.abort_request(rid)
                send({"id": cid, "released": rid})
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    m = out.metrics
                    send(
                        {
                            "id": pending.pop(out.request_id),
                            "tokens": out.outputs[0].token_ids,
                            "finish_reason": out.outputs[0].finish_reason,
                            "error": out.error,
                            "kv_transfer_params": out.kv_transfer_params,
                            "external_cached": m.num_external_cached_tokens if m else None,
                            "local_cached": m.num_local_cached_tokens if m else None,
                        }
                    )
        now = time.monotonic()
        for wait in list(idle_waits):
            cid, started, deadline = wait
            idle = not engine.has_unfinished_requests()
            if idle or now >= deadline:
                idle_waits.remove(wait)
                send({"id": cid, "idle": idle, "elapsed": now - started, **status()})
    engine.shutdown()


if __name__ == "__main__":
    main()
