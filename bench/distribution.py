"""Shipping models: a large model to 4 devices through the fleet's store, against each
device reading a local copy.

A Ray head and 4 raylets on loopback, a node pinned to each raylet with a model cache
of its own; the model is one MatMul whose weights (about 200 MB, 20 in a quick run) are
in an external-data file. (a) Wall time to start the 4 nodes loading a local copy
(after a first such start, not counted, in which Ray starts the worker processes),
then publishing and starting them with empty caches (each fetches from the store),
then deploying the same config again (nothing to send). (b) The fetch alone, on the 4
devices at once, two ways: from the store actor (the product's path) and from chunks
the deployer put in Ray's object store; peak extra memory of each fetching process
(its private resident memory, sampled every 5 ms, less what it was before).
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import psutil
import ray
from onnx import TensorProto, helper, numpy_helper
from ray.cluster_utils import Cluster

from actors.cache import CHUNK_BYTES, READ_AHEAD, ModelCache, StoreSource
from bench.common import RunContext, Section, Target, fmt, log, md_table
from cluster.deploy import LOOPBACK, deploy_nodes, pin_loopback, teardown, use_auth_mode
from cluster.names import NAMESPACE
from cluster.store import publish, start_store
from edgefleet.artifacts import ModelArtifact
from edgefleet.config import parse_config

TITLE = "Shipping models: a large model to 4 devices from the fleet's store"
DEVICES = 4
MiB = 1 << 20


def make_big_model(folder: Path, mb: int) -> Path:
    """``y = x @ W``, W float32 [256, mb * 1024] (``mb`` MiB) in ``model.onnx.data``."""
    cols = mb * MiB // (256 * 4)
    weights = np.random.default_rng(0).standard_normal((256, cols), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", cols])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data")
    return path


@contextlib.contextmanager
def devices() -> Iterator[Cluster]:
    """A Ray head and ``DEVICES`` raylets on loopback, raylet ``i`` offering ``dev-i``."""
    pin_loopback()
    use_auth_mode(token=True)
    if ray.is_initialized():
        ray.shutdown()
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    head = {"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True, head_node_args=head | {"dashboard_agent_listen_port": port}
    )
    try:
        for i in range(DEVICES):
            cluster.add_node(num_cpus=1, resources={f"dev-{i}": 1}, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        cluster.connect(namespace=NAMESPACE)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def timed_deploy(config: Any, ship: bool) -> tuple[float, int]:
    """Seconds to start the nodes (publishing first when ``ship``), bytes they fetched."""
    t0 = time.perf_counter()
    handles = deploy_nodes(publish(config) if ship else config)
    seconds = time.perf_counter() - t0
    statuses = ray.get([h.status.remote() for h in handles.values()], timeout=60)
    teardown(handles, timeout_s=10, fleet=config.fleet.name if ship else None)
    return seconds, sum(m.fetched_bytes for s in statuses for m in s.models)


class Fetcher:
    """On one device: fetch an artifact into an empty cache, timing it and sampling its
    private memory (resident, not shared: Ray's object store maps into every process
    that reads from it, and those pages are the store's)."""

    def ready(self) -> bool:
        return True

    def fetch(self, artifact: ModelArtifact, source: Any, root: str) -> tuple[float, float]:
        me, peak, done = psutil.Process(), [0], threading.Event()

        def private() -> int:
            info = me.memory_info()
            return int(info.rss - info.shared)

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], private())
                time.sleep(0.005)

        before, sampler = private(), threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        ModelCache(Path(root), 1 << 40).ensure(artifact, source)
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        return seconds, max(0, peak[0] - before) / MiB


class ObjectStoreSource:
    """Chunks the deployer put in Ray's object store, read in order."""

    def __init__(self, refs: dict[str, list[Any]]) -> None:
        self.refs = refs

    def chunks(self, sha256: str, size: int) -> Iterator[Any]:
        refs = self.refs[sha256]
        for i, ref in enumerate(refs):
            ahead = refs[i + 1 : i + 1 + READ_AHEAD]  # pulled meanwhile, as the store's
            if ahead:
                ray.wait(ahead, num_returns=len(ahead), timeout=0, fetch_local=True)
            yield ray.get(ref, timeout=120)


def fetch_all(artifact: ModelArtifact, source: Any, work: Path) -> tuple[float, float, float]:
    """The 4 devices fetching at once from ``source``: wall seconds, MiB/s and the
    largest peak extra MiB."""
    remote = ray.remote(num_cpus=0)(Fetcher)
    actors = [remote.options(resources={f"dev-{i}": 0.01}).remote() for i in range(DEVICES)]
    ray.get([a.ready.remote() for a in actors], timeout=120)
    roots = [tempfile.mkdtemp(dir=work) for _ in range(DEVICES)]
    t0 = time.perf_counter()
    out = ray.get(
        [a.fetch.remote(artifact, source, root) for a, root in zip(actors, roots, strict=True)]
    )
    wall = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    return wall, DEVICES * artifact.size / MiB / wall, max(m for _, m in out)


def run(ctx: RunContext) -> Section:
    mb = ctx.count(200, 20)
    work = Path(tempfile.mkdtemp(prefix="ship-"))
    make_big_model(work, mb)
    nodes = [
        {"name": f"d{i}", "resources": {f"dev-{i}": 1}, "model_cache": str(work / f"cache-{i}")}
        for i in range(DEVICES)
    ]
    model = {"path": "model.onnx", "warmup": False, "memory_mb": 4 * mb}
    data = {"fleet": {"name": "ship"}, "models": {"big": model}, "nodes": nodes}
    config = parse_config(data | {"node_defaults": {"memory_budget_mb": 8 * mb}}, work)
    with devices():
        log(f"distribution: {mb} MiB to {DEVICES} devices")
        timed_deploy(config, ship=False)  # warm-up: Ray starts the devices' worker processes
        deploys = [timed_deploy(config, ship) for ship in (False, True, True)]
        published = publish(config).artifacts["big"]
        store = start_store(config)
        from_store = fetch_all(published, StoreSource(store), work)
        chunks: dict[str, list[Any]] = {}
        for f in published.files:
            with (work / f.name).open("rb") as fh:
                read = iter(lambda fh=fh: fh.read(CHUNK_BYTES), b"")
                chunks[f.sha256] = [ray.put(np.frombuffer(c, dtype=np.uint8)) for c in read]
        from_objects = fetch_all(published, ObjectStoreSource(chunks), work)
        ray.kill(store)
    local_s = deploys[0][0]
    labels = ["each device reads a local copy", "published, empty caches", "the same config again"]
    rows = [
        [label, fmt(s, 2), fmt(s / local_s, 2), fmt(fetched / MiB) if i else "0"]
        for i, (label, (s, fetched)) in enumerate(zip(labels, deploys, strict=True))
    ]
    fetch_rows = [
        [label, fmt(s, 2), fmt(rate), fmt(mem)]
        for label, (s, rate, mem) in (
            ("store actor (edgefleet)", from_store),
            ("Ray object store chunks", from_objects),
        )
    ]
    again_mib, peak = deploys[2][1] / MiB, from_store[2] / (CHUNK_BYTES / MiB)
    return Section(
        TITLE,
        " ".join(__doc__.split("\n\n", 1)[1].split()),
        [
            md_table(["deploy of 4 nodes", "seconds", "/ local copy", "MiB fetched"], rows),
            md_table(
                ["fetch on 4 devices at once", "seconds", "MiB/s", "peak extra MiB"], fetch_rows
            ),
        ],
        [
            Target("MiB fetched by a second deploy of the same config", again_mib, "<=", 0),
            Target(
                f"peak extra memory of a fetching device, in chunks of {CHUNK_BYTES // MiB} MiB",
                peak,
                "<=",
                3,
            ),
        ],
        [
            f"Model files: {published.size / MiB:.0f} MiB. All devices share this machine's disk "
            "and CPUs."
        ],
    )
