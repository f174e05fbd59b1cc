"""What a new user meets first: the CLI's errors, defaults, outputs, version, the README's
module-path example and the connector trace, each as the README describes it."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvferry import envs
from kvferry.config import ConfigError, KVTransferConfig
from kvferry.entrypoints import cli
from kvferry.entrypoints.cli import build_parser, main
from kvferry.kv_transfer import trace
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
LONG_PROMPT = (
    "The ferry crossed the river at dawn, carrying the early traders and their goods "
    "to the market on the other side"
)
SMALL = ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-tokens", "2"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    return err


# -- 1. shapes the engine cannot load


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--heads", "3"], "multiple of kv_heads"),
        (["--heads", "3", "--kv-heads", "1"], "multiple of heads"),
        (["--head-dim", "7"], "head_dim .*even"),
        (["--hidden", "250", "--heads", "2", "--kv-heads", "1"], "head_dim .*even"),
        (["--head-dim", "0"], "positive"),
    ],
)
def test_make_tiny_model_refuses_unloadable_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], match: str
) -> None:
    out = tmp_path / "m"
    assert main(["make-tiny-model", str(out), *flags]) == 2
    assert re.search(match, _error_line(capsys))
    assert not out.exists()  # refused before anything is written


@pytest.mark.parametrize(
    "change, match",
    [
        ({"head_dim": 7}, "head_dim 7 is odd"),
        ({"head_dim": None, "hidden_size": 252}, r"head_dim 63 \(hidden_size 252"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"hidden_size": "wide"}, "hidden_size must be a positive integer"),
    ],
)
def test_unloadable_checkpoint_shapes_are_one_line_errors(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    match: str,
) -> None:
    # The shape check comes before any weight is read, so empty weights do.
    folder = tmp_path / "odd"
    folder.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["generate", "--model", str(folder), "--prompt", "hi"]) == 2
    assert re.search(match, _error_line(capsys))


# -- 2. the README's module-path example, as written


def _readme_module_path_command(model: Path) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Load it by module path.*?```bash\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "the README's module-path example is gone"
    command = block.group(1).replace("PATH", shlex.quote(str(model)))
    argv = shlex.split(command.replace('"..."', shlex.quote(LONG_PROMPT)))
    assert argv[0] == "kvferry" and "examples.host_prefix_connector" in command
    return [str(Path(sys.executable).parent / "kvferry"), *argv[1:]]


def test_readme_module_path_example_runs_as_written(model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        _readme_module_path_command(model_dir),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cached: 0 local, 0 external" in proc.stdout


def _connector_class(module_path: str) -> type:
    kvt = KVTransferConfig(
        kv_connector="HostPrefixConnector", kv_role="kv_both", kv_connector_module_path=module_path
    )
    return KVConnectorFactory.get_connector_class(kvt)


def test_module_path_may_be_a_python_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    first = _connector_class("examples/host_prefix_connector.py")
    # Imported once: the scheduler and worker sides must share the metadata classes.
    assert _connector_class(str(ROOT / "examples" / "host_prefix_connector.py")) is first
    assert first.__name__ == "HostPrefixConnector"
    with pytest.raises(ConfigError, match="does not exist"):
        _connector_class("examples/no_such_connector.py")


def test_module_path_found_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "newcomer_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(ROOT / "examples" / "host_prefix_connector.py", package / "conn.py")
    monkeypatch.chdir(tmp_path)
    # As under the `kvferry` console script: the working directory is not on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("newcomer_pkg", "newcomer_pkg.conn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert _connector_class("newcomer_pkg.conn").__module__ == "newcomer_pkg.conn"
        with pytest.raises(ConfigError, match="newcomer_pkg.nope"):
            _connector_class("newcomer_pkg.nope")
    finally:
        for name in ("newcomer_pkg", "newcomer_pkg.conn"):
            sys.modules.pop(name, None)


# -- 3. cached tokens and stats in generate's output


def test_generate_shows_connector_hits_and_final_stats(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
        }
    )
    argv = ["generate", "--model", str(model_dir), *SMALL, "--kv-transfer-config", kv]
    argv += ["--prompt", LONG_PROMPT]
    assert main([*argv, "--json"]) == 0  # stores the prompt's blocks
    first = json.loads(capsys.readouterr().out)
    assert first["num_local_cached_tokens"] == 0 and first["num_external_cached_tokens"] == 0

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvferry").addHandler(handler)
    try:
        assert main([*argv, "--log-stats"]) == 0  # loads them
    finally:
        logging.getLogger("kvferry").removeHandler(handler)
    hit = (first["num_prompt_tokens"] - 1) // 16 * 16
    assert hit > 0
    assert f"cached: 0 local, {hit} external of {first['num_prompt_tokens']}" in (
        capsys.readouterr().out
    )
    stats = [r for r in records if r.startswith("engine stats")]
    assert stats and f"num_external_cached_tokens={hit}" in stats[-1]


# -- 5. temperature default as in vLLM


def test_generate_temperature_default_matches_sampling_params() -> None:
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"])
    assert args.temperature == SamplingParams().temperature == 1.0


# -- 6. --version


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    import kvferry

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"kvferry {metadata.version('kvferry')}\n"

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli._version() == kvferry.__version__


# -- 7. --tensor-parallel-size


def test_tensor_parallel_size_that_does_not_divide_the_model_is_refused(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    assert "model heads must divide by it" in " ".join(generate.format_help().split())
    argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--tensor-parallel-size"]
    assert main([*argv, "3"]) == 2
    assert "tensor_parallel_size=3 does not divide the model's" in _error_line(capsys)


# -- 4. one trace per run


class _Engine:
    """Stands for one engine's config: runs are told apart by identity."""


def _trace_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_starts_fresh_per_run_unless_appending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.jsonl"
    record = {"t": 0.0, "role": "scheduler", "method": "build_connector_meta", "req_ids": ["a"]}

    def process_run(append: bool) -> list[trace.TraceWriter]:
        monkeypatch.setattr(trace, "_RUNS", {})  # a new process
        monkeypatch.setenv("KVFERRY_TRACE_APPEND", "1" if append else "0")
        assert envs.trace_append() is append
        engine = _Engine()
        scheduler, worker = trace.run_writer(path, engine), trace.run_writer(path, engine)
        scheduler.write(record)
        worker.write({**record, "role": "worker", "method": "start_load_kv"})
        return [scheduler, worker]

    process_run(append=False)
    scheduler, worker = process_run(append=False)
    assert scheduler is worker  # one run per engine, shared by both sides
    records = _trace_records(path)
    assert [r["method"] for r in records] == ["run_start", "build_connector_meta", "start_load_kv"]
    assert {r["run"] for r in records} == {scheduler.run_id}

    process_run(append=True)
    assert len(trace.read_runs(path)) == 2
    # A second engine in the same process adds a run, never truncating the first's.
    other = trace.run_writer(path, _Engine())
    other.write(record)
    assert len(trace.read_runs(path)) == 3


def test_trace_renders_one_diagram_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    a, b = trace.TraceWriter(path), trace.TraceWriter(path, append=True)
    # Interleaved, as two processes appending at once would write them.
    a.write({"t": 1.0, "role": "scheduler", "method": "build_connector_meta", "req_ids": ["ra"]})
    b.write({"t": 1.0, "role": "scheduler", "method": "build_connector_meta", "req_ids": ["rb"]})
    b.write({"t": 2.0, "role": "scheduler", "method": "request_finished", "req_ids": ["rb"]})

    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("sequenceDiagram") == 2 and out.count("```mermaid") == 2
    first, second = out.split("## run 2 of 2")
    assert "(ra)" in first and "(rb)" not in first
    assert "(rb)" in second and "request_finished" in second

    assert main(["trace", str(path), "--run", "-1"]) == 0
    last = capsys.readouterr().out
    assert last.startswith("sequenceDiagram") and "(rb)" in last and "(ra)" not in last
    assert main(["trace", str(path), "--run", "3"]) == 2
    assert "holds 2 run(s)" in _error_line(capsys)
