"""A device's model cache: the files of the models its nodes serve, fetched from the
fleet's store, checked against their sha256 and loaded from here only.

Layout under the cache folder (shared by every node on the device)::

    blobs/<sha256>            a file's bytes, named by their digest
    trees/<tree digest>/...   a model's folder: hard links to blobs under their names
    tmp/                      files being fetched (renamed into blobs/ when complete)

A blob is written to ``tmp/``, hashed as it arrives, synced and renamed: a blob under
``blobs/`` is always whole. A tree is built in ``tmp/`` and renamed too. A node checks
a tree's files against their digests the first time it uses the tree; a file that does
not match is removed and fetched again. Past the size limit, the trees used longest
ago (by any node on the device) and blobs no tree links are removed, never a tree
this node serves or one used within ``EVICT_MIN_AGE_S``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edgefleet.artifacts import ArtifactFile, ModelArtifact, sha256_file
from edgefleet.config import ModelConfig
from edgefleet.errors import EngineError

log = logging.getLogger(__name__)

EVICT_MIN_AGE_S = 60.0  # a tree another node on the device used this recently stays
CHUNK_BYTES = 8 << 20  # what one read from the store returns
CHUNK_TIMEOUT_S = 120.0  # one chunk read or write; a store that takes longer is lost
READ_GROUP = "read"  # the store actor's concurrency group serving reads
# Reads in flight past the one being written: a transfer between machines is paced by
# its latency, not its bandwidth, with fewer (the chunks wait in the object store).
READ_AHEAD = 4


class ArtifactError(EngineError):
    """A model's files could not be fetched into the cache, or do not match their digest."""


class ChunkSource(Protocol):
    """Where a node fetches a blob from: its bytes, a chunk at a time, in order."""

    def chunks(self, sha256: str, size: int) -> Iterator[Any]:
        """Bytes-like chunks (bytes, or a uint8 array) in order."""
        ...


@dataclass
class Fetched:
    """What making a tree ready took."""

    tree: Path
    bytes_fetched: int = 0
    files_fetched: int = 0
    refetched: int = 0  # cached files that did not match their digest


def default_cache_dir() -> Path:
    """edgefleet/models under this device's user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "edgefleet" / "models"


class ModelCache:
    """The model cache under ``root`` (see the module's docstring), at most ``limit_bytes``."""

    def __init__(self, root: Path | None, limit_bytes: int) -> None:
        self.root = (root or default_cache_dir()).expanduser()
        self.limit_bytes = limit_bytes
        self._blobs = self.root / "blobs"
        self._trees = self.root / "trees"
        self._tmp = self.root / "tmp"
        for d in (self._blobs, self._trees, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()  # trees checked byte for byte by this process
        self._lock = threading.Lock()

    def tree(self, artifact: ModelArtifact) -> Path:
        return self._trees / artifact.digest

    def ensure(
        self, artifact: ModelArtifact, source: ChunkSource, keep: Iterable[str] = ()
    ) -> Fetched:
        """Make ``artifact``'s tree whole in the cache, fetching from ``source`` what it
        lacks or holds corrupted; then keep the cache within its limit (never removing
        this tree nor those of ``keep``). ArtifactError when a file cannot be fetched or
        arrives unlike its digest."""
        with self._lock:
            done = self._ensure(artifact, source)
            self._evict({artifact.digest, *keep})
            return done

    def _ensure(self, artifact: ModelArtifact, source: ChunkSource) -> Fetched:
        tree = self.tree(artifact)
        verify = artifact.digest not in self._verified
        bad = self._bad_files(tree, artifact.files, verify) if tree.is_dir() else None
        if bad == []:
            self._touch(tree)
            self._verified.add(artifact.digest)
            return Fetched(tree)
        done = Fetched(tree, refetched=len(bad or []))
        # Files of the tree found whole were hashed there: no need again for the blob
        # that is the same file (a hard link; not a copy).
        checked = {
            f.name
            for f in artifact.files
            if bad is not None
            and f.name not in bad
            and _same_file(tree / f.name, self._blobs / f.sha256)
        }
        if bad:  # a corrupted tree: its bad files' blobs are the same inodes, so both go
            log.warning("model cache: %s does not match its digests; fetching again", bad)
            shutil.rmtree(tree, ignore_errors=True)
            for f in artifact.files:
                if f.name in bad:
                    with contextlib.suppress(FileNotFoundError):
                        (self._blobs / f.sha256).unlink()
        for f in artifact.files:
            blob = self._blobs / f.sha256
            if blob.is_file() and blob.stat().st_size == f.size:
                if not verify or f.name in checked or sha256_file(blob) == f.sha256:
                    continue
                blob.unlink()
                done.refetched += 1
            self._fetch(f, source)
            done.bytes_fetched += f.size
            done.files_fetched += 1
        self._link_tree(artifact)
        self._verified.add(artifact.digest)
        return done

    def _bad_files(self, tree: Path, files: Iterable[ArtifactFile], verify: bool) -> list[str]:
        """The files of ``tree`` that are missing, of another size or (``verify``) of
        other bytes than their digest says."""
        bad = []
        for f in files:
            path = tree / f.name
            try:
                whole = path.stat().st_size == f.size
            except OSError:
                whole = False
            if not whole or (verify and sha256_file(path) != f.sha256):
                bad.append(f.name)
        return bad

    def _fetch(self, f: ArtifactFile, source: ChunkSource) -> None:
        tmp = self._tmp / f"{f.sha256}.{uuid.uuid4().hex}"
        h = hashlib.sha256()
        size = 0
        try:
            with tmp.open("wb") as out:
                for chunk in source.chunks(f.sha256, f.size):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            if size != f.size or h.hexdigest() != f.sha256:
                raise ArtifactError(
                    f"{f.name}: fetched {size} bytes of sha256 {h.hexdigest()[:12]}, "
                    f"expected {f.size} of {f.sha256[:12]}"
                )
            os.replace(tmp, self._blobs / f.sha256)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _link_tree(self, artifact: ModelArtifact) -> None:
        building = self._tmp / f"tree-{artifact.digest}.{uuid.uuid4().hex}"
        try:
            for f in artifact.files:
                target = building / f.name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(self._blobs / f.sha256, target)
                except OSError:  # a file system without hard links: a copy
                    shutil.copyfile(self._blobs / f.sha256, target)
            try:
                os.rename(building, self.tree(artifact))
            except OSError:  # another node on the device made it meanwhile
                if not self.tree(artifact).is_dir():
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)

    # ----------------------------------------------------------------- size limit

    def size(self) -> int:
        """Bytes of the blobs held (trees link them: they add none)."""
        return sum(p.stat().st_size for p in self._blobs.iterdir() if p.is_file())

    def _evict(self, keep: set[str]) -> None:
        total = self.size()
        if total <= self.limit_bytes:
            return
        now = time.time()
        trees = sorted(
            (p for p in self._trees.iterdir() if p.name not in keep),
            key=lambda p: p.stat().st_mtime,
        )
        for tree in [None, *trees]:  # first the blobs no tree links, then tree by tree
            if tree is not None:
                if now - tree.stat().st_mtime < EVICT_MIN_AGE_S:
                    continue
                shutil.rmtree(tree, ignore_errors=True)
                log.info("model cache: removed %s (least recently used)", tree.name[:12])
            total -= self._remove_unlinked_blobs(now)
            if total <= self.limit_bytes:
                return
        log.warning(
            "model cache %s holds %.0f MiB, over its limit of %.0f MiB: every model in it "
            "is in use",
            self.root,
            total / 2**20,
            self.limit_bytes / 2**20,
        )

    def _remove_unlinked_blobs(self, now: float) -> int:
        """Remove the blobs no tree links (but one fetched just now: a node on the
        device may be about to link it); returns the bytes freed."""
        freed = 0
        for blob in self._blobs.iterdir():
            st = blob.stat()
            if st.st_nlink == 1 and now - st.st_mtime >= EVICT_MIN_AGE_S:
                blob.unlink()
                freed += st.st_size
        return freed

    @staticmethod
    def _touch(tree: Path) -> None:
        with contextlib.suppress(OSError):
            os.utime(tree)


class StoreSource:
    """A node's way to read blobs from the store: chunk by chunk, ``READ_AHEAD`` ahead."""

    def __init__(self, store: Any, chunk_bytes: int = CHUNK_BYTES, *, name: str = "") -> None:
        self._store = store
        self._name = name
        self._chunk = chunk_bytes

    @classmethod
    def named(cls, name: str) -> StoreSource:
        """The source reading from the store actor ``name``, looked up at the first
        read (a cache that lacks nothing never asks for it)."""
        return cls(None, name=name)

    def _actor(self) -> Any:
        if self._store is None:
            import ray

            from cluster.names import NAMESPACE

            try:
                self._store = ray.get_actor(self._name, namespace=NAMESPACE)
            except ValueError:
                raise ArtifactError(
                    f"the fleet's model store {self._name!r} is not running: a node "
                    "fetches the models' files from it"
                ) from None
        return self._store

    def chunks(self, sha256: str, size: int) -> Iterator[Any]:
        # A future, not ray.get: the node is an asyncio actor, and this runs on its
        # engine thread, where blocking is what is meant. Chunks are uint8 arrays in
        # Ray's object store (shared memory), read without a copy.
        pending: deque[Any] = deque()
        try:
            for offset in range(0, size, self._chunk):
                read = self._actor().read.options(concurrency_group=READ_GROUP)
                pending.append(read.remote(sha256, offset, self._chunk).future())
                if len(pending) > READ_AHEAD:
                    yield pending.popleft().result(timeout=CHUNK_TIMEOUT_S)
            while pending:
                yield pending.popleft().result(timeout=CHUNK_TIMEOUT_S)
        except ArtifactError:
            raise
        except Exception as exc:  # a store that died or did not answer in time
            why = "no answer" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise ArtifactError(
                f"fetching {sha256[:12]} from the fleet's model store failed ({why})"
            ) from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def in_tree(config: ModelConfig, artifact: ModelArtifact, tree: Path) -> ModelConfig:
    """``config`` loading its files from ``tree`` (the cache's copy of ``artifact``)."""
    variants = {p: tree / name for p, name in artifact.variants.items()}
    return config.model_copy(update={"path": tree / artifact.path, "variants": variants})


def file_source(files: dict[str, Path], chunk_bytes: int = 1 << 20) -> ChunkSource:
    """A source reading blobs from local files by digest (the tests' store)."""

    class _Files:
        def chunks(self, sha256: str, size: int) -> Iterator[bytes]:
            with files[sha256].open("rb") as fh:
                while chunk := fh.read(chunk_bytes):
                    yield chunk

    return _Files()
