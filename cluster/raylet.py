"""A worker raylet on loopback that joins a head: another machine of the cluster, on
this one (tests and benchmarks of multi-machine behaviour: a head restart, a machine
that dies or freezes).

``ray start --address`` refuses a head on 127.0.0.1 unless Ray's multi-machine mode
is on, and that mode swaps 127.0.0.1 for this machine's address; so the raylet is
started from this process the way ``ray start`` starts one, with loopback pinned. It
outlives this process, like ``ray start``'s; everything it runs names its own folder,
by which :func:`raylet_processes` finds it (workers rename themselves, so their
parents are followed too).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from cluster.deploy import pin_loopback, use_auth_mode
from cluster.head import LOOPBACK, _free_port, _gone, processes_naming
from edgefleet.errors import FleetStartError

# A raylet of another Python (its own ONNX Runtime build) imports it all before it
# registers: on a busy 2-core machine one did not within 60 s.
DEVICE_ALIVE_S = 180.0
OBJECT_STORE_BYTES = 100 * 1024 * 1024
_SOURCE = Path(__file__).resolve().parents[1]  # the checkout another Python imports from


def start_raylet(
    address: str,
    directory: Path,
    *,
    resources: Mapping[str, float],
    labels: Mapping[str, str] | None = None,
    num_cpus: int = 1,
    token_auth: bool = True,
) -> None:
    """Start a worker raylet bound to 127.0.0.1 that joins the head at ``address``,
    its Ray folder ``directory`` (keep it short: Ray puts Unix sockets there), with
    ``num_cpus``, custom ``resources`` and Ray node ``labels`` (a device's, as
    ``edgefleet join --labels`` gives them); returns once it has joined. Pins this
    process to loopback and sets its authentication mode (see cluster.deploy), which
    the raylet inherits. Raises FleetStartError when it does not start (what it
    started is stopped)."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    pin_loopback()
    use_auth_mode(token=token_auth)
    params = RayParams(
        gcs_address=address,
        node_ip_address=LOOPBACK,
        temp_dir=str(directory),
        num_cpus=num_cpus,
        resources=dict(resources),
        labels=dict(labels or {}),
        object_store_memory=OBJECT_STORE_BYTES,
        dashboard_agent_listen_port=_free_port(),
        include_log_monitor=False,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
    )
    try:
        Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    except Exception as exc:
        kill_raylet(directory)
        raise FleetStartError(f"a raylet did not join {address}: {exc}") from exc


_WITH_PYTHON = """
import json, sys
from pathlib import Path
from cluster.raylet import start_raylet
a = json.loads(sys.argv[1])
start_raylet(a["address"], Path(a["directory"]), resources=a["resources"], labels=a["labels"],
             num_cpus=a["num_cpus"], token_auth=a["token_auth"])
"""


def start_raylet_with(
    python: Path,
    address: str,
    directory: Path,
    *,
    labels: Mapping[str, str],
    resources: Mapping[str, float] | None = None,
    num_cpus: int = 1,
    token_auth: bool = True,
    timeout_s: float = 180.0,
) -> None:
    """:func:`start_raylet` run by another Python (another virtual environment, with
    edgefleet and the same Ray installed): the raylet's workers run that Python, so the
    node actors placed there import its packages (its ONNX Runtime build: a device of
    another kind on this machine). FleetStartError when it does not join."""
    args = {
        "address": address,
        "directory": str(directory),
        "resources": dict(resources or {}),
        "labels": dict(labels),
        "num_cpus": num_cpus,
        "token_auth": token_auth,
    }
    env = dict(os.environ, RAY_AUTH_MODE="token" if token_auth else "disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SOURCE), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(
            [str(python), "-c", _WITH_PYTHON, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        kill_raylet(directory)
        raise FleetStartError(
            f"a raylet of {python} did not join {address} in {timeout_s:g} s"
        ) from None
    if done.returncode != 0:
        kill_raylet(directory)
        said = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise FleetStartError(f"a raylet of {python} did not join {address}: {said[0]}")


@contextlib.contextmanager
def head_and_device(
    python: Path, *, head_labels: Mapping[str, str], device_labels: Mapping[str, str]
) -> Iterator[Any]:
    """A Ray head on loopback (2 CPUs, resource ``head``, ``head_labels``) and one
    device joined to it whose raylet runs ``python`` (see :func:`start_raylet_with`),
    this process connected to the head (in the fleet's namespace); both stopped at the
    end. The Ray this process ran before, if any, is shut down first. Token
    authentication, as the project's embedded Ray speaks it: one process cannot switch
    Ray's authentication mode."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.names import NAMESPACE

    if ray.is_initialized():
        ray.shutdown()
    pin_loopback()
    use_auth_mode(token=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"head": 1},
            "labels": dict(head_labels),
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "dashboard_agent_listen_port": _free_port(),
        },
    )
    device_dir = Path(tempfile.mkdtemp(prefix="dev-", dir="/tmp"))  # short: Unix sockets
    try:
        start_raylet_with(python, cluster.address, device_dir, labels=device_labels)
        cluster.connect(namespace=NAMESPACE)
        deadline = time.monotonic() + DEVICE_ALIVE_S
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline:
                raise FleetStartError(
                    f"the raylet of {python} did not show ALIVE in {DEVICE_ALIVE_S:g} s"
                )
            time.sleep(0.2)
        yield cluster
    finally:
        ray.shutdown()
        kill_raylet(device_dir)
        cluster.shutdown()
        shutil.rmtree(device_dir, ignore_errors=True)


def raylet_processes(directory: Path) -> list[psutil.Process]:
    """Every process of the raylet whose folder is ``directory``: the raylet, its
    agents and its workers."""
    return processes_naming([str(directory)], skip=(os.getpid(),))


def the_raylet(directory: Path) -> psutil.Process | None:
    """The raylet process itself, while it runs."""
    for proc in raylet_processes(directory):
        try:
            if proc.name() == "raylet" and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.Error:
            continue
    return None


def kill_raylet(directory: Path, timeout_s: float = 10.0) -> int:
    """The machine dies: SIGKILL every process of that raylet, and wait (at most
    ``timeout_s``) until they are gone; how many there were."""
    procs = raylet_processes(directory)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + timeout_s
    # Not psutil.wait_procs: a process that is not our child stays a zombie until its
    # parent reaps it, and is gone for all that matters here.
    while any(not _gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(procs)
