"""The fleet's model store: the files a deploy published, served to nodes in chunks.

At deploy (``edgefleet up``, ``FleetClient.local``) the deployer hashes each served
model's files (:mod:`edgefleet.artifacts`) and uploads to the store those it lacks;
then every node fetches from the store what its own cache lacks
(:mod:`actors.cache`) and loads from its cache only. A file already in the store or in
a node's cache is not sent again.

The store is one actor per fleet, named ``FLEET/store``, on the deployer's machine
(the head, for ``up``), keeping the files on its disk under ``edgefleet/store/<fleet>``
in the user's cache folder: a restarted store serves them again, and so does one
restarted with the head. It answers chunk reads of ``CHUNK_BYTES``; a node keeps
one read in flight ahead of the one it writes, so neither side holds a whole model in
memory. Why a store actor and not Ray's object store: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.cache import CHUNK_BYTES, CHUNK_TIMEOUT_S, READ_GROUP, default_cache_dir
from cluster.names import NAMESPACE
from edgefleet.artifacts import ModelArtifact, describe_files, sha256_file
from edgefleet.config import FleetConfig, ModelConfig
from edgefleet.errors import ConfigError, FleetStartError, RolloutRefused

READ_THREADS = 4  # the store's threads serving chunk reads: nodes fetch side by side
IN_FLIGHT = 2  # chunks sent ahead: memory stays at a few chunks on either side
Progress = Callable[[str], None]


def store_name(fleet: str) -> str:
    return f"{fleet}/store"


class ModelStore:
    """The store actor (see the module's docstring)."""

    def __init__(self, fleet: str) -> None:
        self.root = default_cache_dir().parent / "store" / fleet
        self._blobs = self.root / "blobs"
        self._tmp = self.root / "tmp"
        for d in (self._blobs, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._published = self.root / "published.json"

    def missing(self, digests: list[str]) -> list[str]:
        """Those of ``digests`` the store does not hold."""
        return [d for d in digests if not (self._blobs / d).is_file()]

    def write(self, digest: str, offset: int, data: bytes) -> None:
        """Write a chunk of the blob ``digest`` at ``offset`` (chunks in any order)."""
        fd = os.open(self._tmp / digest, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def commit(self, digest: str, size: int) -> None:
        """The blob ``digest`` is whole: check it and keep it. ValueError when its bytes
        do not match (nothing is kept)."""
        tmp = self._tmp / digest
        tmp.touch()  # an empty file has no chunks
        with tmp.open("rb+") as fh:
            os.fsync(fh.fileno())
        got = tmp.stat().st_size
        if got != size or sha256_file(tmp) != digest:
            tmp.unlink()
            raise ValueError(f"blob {digest[:12]}: received {got} bytes of another digest")
        os.replace(tmp, self._blobs / digest)

    def read(self, digest: str, offset: int, size: int) -> np.ndarray:
        """``size`` bytes of the blob ``digest`` from ``offset``, as a uint8 array: Ray
        passes arrays out of band, so the node reads it from its object store without
        a copy into its own memory."""
        with (self._blobs / digest).open("rb") as fh:
            fh.seek(offset)
            return np.frombuffer(fh.read(size), dtype=np.uint8)

    def publish(self, artifacts: dict[str, dict[str, Any]]) -> int:
        """Record the models' current artifacts (kept on disk for a restarted store),
        forget the versions rollouts made (a deploy starts from its own files), and
        remove the files neither these, the ones published before, nor those versions
        hold; returns the bytes removed."""
        keep = {
            f["sha256"]
            for a in (*artifacts.values(), *self.published().values())
            for f in a["files"]
        }
        for kept in self.root.glob("*.keep"):  # the versions rollouts published
            keep.update(json.loads(kept.read_text()))
        tmp = self._published.with_suffix(".tmp")
        tmp.write_text(json.dumps(artifacts, indent=1))
        os.replace(tmp, self._published)
        for state in self.root.glob("*.state"):  # a deploy starts from its own files
            state.unlink()
            state.with_suffix(".keep").unlink(missing_ok=True)
        freed = 0
        for blob in self._blobs.iterdir():
            if blob.name not in keep:
                freed += blob.stat().st_size
                blob.unlink()
        return freed

    def save_state(self, key: str, state: Any, keep: list[str]) -> None:
        """Keep ``state`` (the router's record of the fleet's versions: see
        cluster/rollout.py) under ``key``, and the blobs ``keep`` with it until the
        next deploy."""
        path = self.root / f"{key}.state"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(state))
        os.replace(tmp, path)
        path.with_suffix(".keep").write_text(json.dumps(keep))

    def load_state(self, key: str) -> Any:
        """What :meth:`save_state` kept under ``key`` since the last deploy, or None."""
        path = self.root / f"{key}.state"
        return pickle.loads(path.read_bytes()) if path.is_file() else None

    def published(self) -> dict[str, dict[str, Any]]:
        if not self._published.is_file():
            return {}
        data: dict[str, dict[str, Any]] = json.loads(self._published.read_text())
        return data


def start_store(config: FleetConfig) -> ActorHandle:
    """The fleet's store actor: the one running, else a new one on this machine."""
    name = store_name(config.fleet.name)
    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(concurrency_groups={READ_GROUP: READ_THREADS})(ModelStore)
        .options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        )
        .remote(config.fleet.name)
    )


def publish(config: FleetConfig, progress: Progress | None = None) -> FleetConfig:
    """Hash the files of every model ``config``'s nodes serve, upload to the fleet's
    store those it lacks, and return ``config`` with the artifacts its nodes fetch.
    FleetStartError when the store does not answer or a file changes while sent."""
    say = progress or (lambda _: None)
    artifacts: dict[str, ModelArtifact] = {}
    local: dict[str, Path] = {}  # digest -> a file of it here
    for name in sorted(config.served_models()):
        model = config.models[name]
        artifact, files = describe_files(
            name, model.path, model.variants, model.kind, model.version
        )
        artifacts[name] = artifact
        local.update({f.sha256: files[f.name] for f in artifact.files})
    store = start_store(config)
    try:
        missing = ray.get(store.missing.remote(sorted(local)), timeout=CHUNK_TIMEOUT_S)
        sizes = {f.sha256: f.size for a in artifacts.values() for f in a.files}
        if missing:
            total = sum(sizes[d] for d in missing)
            say(f"uploading {len(missing)} model file(s), {total / 2**20:.1f} MiB, to the store")
        for digest in missing:
            _upload(store, digest, local[digest], sizes[digest])
        payload = {n: asdict(a) for n, a in artifacts.items()}
        ray.get(store.publish.remote(payload), timeout=CHUNK_TIMEOUT_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ValueError) as exc:
        raise FleetStartError(f"could not publish the models to the store: {exc}") from None
    for a in artifacts.values():
        say(f"model {a.describe()}")
    return config.with_artifacts(artifacts, store_name(config.fleet.name))


def upload_files(
    config: FleetConfig, name: str, model: ModelConfig, progress: Progress | None = None
) -> ModelArtifact:
    """Hash ``model``'s files (another version of the fleet's model ``name``) and upload
    to the fleet's store those it lacks; the artifact nodes fetch. RolloutRefused when
    a file is missing or the store does not take them."""
    say = progress or (lambda _: None)
    try:
        artifact, files = describe_files(
            name, model.path, model.variants, model.kind, model.version
        )
    except ConfigError as exc:
        raise RolloutRefused(f"refused: {exc}") from None
    local = {f.sha256: files[f.name] for f in artifact.files}
    sizes = {f.sha256: f.size for f in artifact.files}
    store = start_store(config)
    try:
        missing = ray.get(store.missing.remote(sorted(local)), timeout=CHUNK_TIMEOUT_S)
        if missing:
            total = sum(sizes[d] for d in missing)
            say(f"uploading {len(missing)} file(s), {total / 2**20:.1f} MiB, to the store")
        for digest in missing:
            _upload(store, digest, local[digest], sizes[digest])
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ValueError) as exc:
        raise RolloutRefused(f"could not upload {name}'s new files to the store: {exc}") from None
    return artifact


def _upload(store: ActorHandle, digest: str, path: Path, size: int) -> None:
    pending: deque[ray.ObjectRef] = deque()
    with path.open("rb") as fh:
        offset = 0
        while chunk := fh.read(CHUNK_BYTES):
            pending.append(store.write.remote(digest, offset, chunk))
            offset += len(chunk)
            del chunk
            if len(pending) >= IN_FLIGHT:
                ray.get(pending.popleft(), timeout=CHUNK_TIMEOUT_S)
    ray.get(list(pending), timeout=CHUNK_TIMEOUT_S)
    ray.get(store.commit.remote(digest, size), timeout=CHUNK_TIMEOUT_S)


def stop_store(fleet: str) -> None:
    """End the fleet's store actor (its files stay on disk for the next deploy)."""
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(store_name(fleet), namespace=NAMESPACE), no_restart=True)
