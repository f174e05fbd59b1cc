"""One kvferry engine in its own process: ``python -m ...engine_proc JOB.json`` generates the
job's prompts greedily, checks for leaks, and writes ``JOB.out.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.kv_transfer.connectors.lmcache_mp.harness import drain_and_check, generate, make_llm


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    llm = make_llm(Path(job["model"]), job["kv"], tensor_parallel_size=job.get("tp", 1))
    outputs = generate(llm, job["prompts"])
    stats = drain_and_check(llm)
    out = Path(job_path).with_suffix(".out.json")
    out.write_text(json.dumps({"outputs": outputs, "stats": stats}))


if __name__ == "__main__":
    main(sys.argv[1])
