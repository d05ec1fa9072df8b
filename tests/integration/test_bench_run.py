"""The benchmarks' command, `python -m bench.run`, as a user runs it from the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.run import build_parser

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_bench_quick_smoke_run_prints_a_report(tmp_path):
    out = tmp_path / "results.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--only", "priority_latency"]
        + ["--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert report.startswith("# edgefleet benchmark results")
    assert "Foreground latency under a background flood" in report
    assert "| FIFO" in report and "| edgefleet" in report


def test_help_shows_the_options_and_an_example():
    text = " ".join(build_parser().format_help().split())
    shown = ["--quick", "--only NAME", "--out PATH", "priority_latency", "python -m bench.run"]
    for words in shown:
        assert words in text, words
