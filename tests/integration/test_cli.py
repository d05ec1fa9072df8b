"""The edgefleet command, run as a user runs it: in a subprocess, checking exit codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def edgefleet(*args: str, cwd: Path = REPO, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_commands_with_examples():
    result = edgefleet("--help")
    assert result.returncode == 0
    for word in ("demo", "models", "validate", "bench", "examples:"):
        assert word in result.stdout


def test_models_make_writes_every_model(tmp_path):
    result = edgefleet("models", "make", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "m").glob("*.onnx"))
    assert names == [
        "classifier.onnx",
        "detector.onnx",
        "heavy.onnx",
        "slow.onnx",
        "stateful.onnx",
    ]
    assert "[5/5]" in result.stdout
    bad = edgefleet("models", "make", str(tmp_path / "m"), "--only", "gpt5")
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_validate_good_and_bad(tmp_path):
    ok = edgefleet("validate", "configs/local.yaml")
    assert ok.returncode == 0 and "valid" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  a: {path: a.onnx, batching: {window_ms: fast}}\n")
    bad = edgefleet("validate", str(broken))
    assert bad.returncode == 2
    assert "models.a.batching.window_ms (line 2)" in bad.stderr


def test_demo_runs_to_its_report(tmp_path):
    shutil.copy(REPO / "configs" / "local.yaml", tmp_path / "local.yaml")
    result = edgefleet("demo", "--config", str(tmp_path / "local.yaml"), "--duration", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "generating model classifier" in out  # models made on first run
    assert "running a mixed workload" in out
    for cls in ("foreground", "inline", "background", "offline"):
        assert any(line.startswith(cls) for line in out.splitlines()), cls
    assert "ran on: edge-0" in out


def test_bench_quick_smoke_run_prints_a_report(tmp_path):
    out = tmp_path / "results.md"
    result = edgefleet("bench", "--quick", "--only", "priority_latency", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert report.startswith("# edgefleet benchmark results")
    assert "Foreground latency under a background flood" in report
    assert "| FIFO" in report and "| edgefleet" in report
