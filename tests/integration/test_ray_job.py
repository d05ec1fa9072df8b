"""`ray job submit` end to end: a real Ray head on loopback (token authentication,
dashboard and job API on 127.0.0.1), a job that deploys configs/fleet.yaml and
returns, a second job and a separate client process that use the fleet, and a job
that stops it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.head import _free_port, head_processes, start_head, stop_head

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.integration

CLIENT = """
from edgefleet import FleetClient
from edgefleet.modelgen import random_inputs

fleet = FleetClient.connect("{address}", fleet="fleet")
print("logits", fleet.infer("detector", random_inputs("detector"))["heatmap"].shape)
print("tokens", fleet.generate("tiny_lm", [1, 2, 3], max_new_tokens=4).collect())
print("nodes", sorted(n.name for n in fleet.status().nodes))
"""


def test_ray_job_submit_deploys_a_fleet_other_jobs_and_clients_use(tmp_path):
    head = f"jobhead{os.getpid()}"
    work = tmp_path / "checkout"
    (work / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "fleet.yaml", work / "configs" / "fleet.yaml")
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")

    def job(*command: str, working_dir: Path | None = None) -> subprocess.CompletedProcess:
        where = ["--working-dir", str(working_dir)] if working_dir else []
        submit = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{port}"]
        for _ in range(30):  # Ray's job agent may still be starting: it says to retry
            result = subprocess.run(
                [*submit, *where, "--", *command],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if "No available agent to submit job" not in result.stderr + result.stdout:
                break
            time.sleep(1.0)
        return result

    address = start_head(head, 4, dashboard_port=port)
    try:
        # The models are not in the uploaded folder: `up` writes the built-in ones.
        up = job("edgefleet", "up", "configs/fleet.yaml", "--detach", working_dir=work)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert "fleet 'fleet' is up: 3 node(s)" in up.stdout
        assert f"connecting to the Ray cluster at {address}" in up.stdout

        gen = job("edgefleet", "generate", "tiny_lm", "--fleet", "fleet", "--prompt-ids", "5", "6")
        assert gen.returncode == 0, gen.stdout[-3000:]
        assert "finish: length (64 tokens on assistant" in gen.stdout

        client = subprocess.run(
            [sys.executable, "-c", CLIENT.format(address=address)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        assert "logits (1, 5, 32, 32)" in client.stdout
        assert "nodes ['assistant', 'camera-0', 'camera-1']" in client.stdout

        down = job("edgefleet", "down", "--fleet", "fleet")
        assert down.returncode == 0, down.stdout[-3000:]
        assert "fleet 'fleet' stopped (3 node(s) and its router)" in down.stdout
        status = job("edgefleet", "status", "--fleet", "fleet")
        assert status.returncode != 0 and "no fleet" in status.stdout.lower()
    finally:
        stop_head(head)
    assert head_processes(head) == []
