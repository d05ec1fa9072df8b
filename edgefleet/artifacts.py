"""A model's files as content-addressed artifacts: what a deploy publishes and a node
fetches into its cache.

A model is a *tree* of files under one folder: its ONNX file (and each provider
variant), the external-data files those reference, and the files a node reads beside
a decoder (its ``config.json``, ``genai_config.json``, tokenizer files). Each file is
named by the sha256 of its bytes; the tree by the sha256 of its listing, so two
deploys of the same bytes name the same tree and a node that holds it fetches
nothing. A model's *version* is its YAML ``version:``, else the tree digest's first 12
hex digits.

No Ray and no ONNX Runtime here: the deployer (cluster/store.py) and the node's cache
(actors/cache.py) share these definitions.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.errors import ConfigError

if TYPE_CHECKING:
    import onnx

HASH_CHUNK = 1 << 20  # bytes read at a time when hashing: memory stays flat
SHORT = 12  # hex digits of a digest shown, and a version without `version:`
# Files a node reads beside a model's ONNX file when they are there: the decoder's
# facts and stop ids (actors/decoder.py), the caller's tokenizer (cluster/text.py).
SIDE_FILES = (
    "config.json",
    "genai_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ArtifactFile:
    """One file of a model's tree: its path in the tree, sha256 and size."""

    name: str  # relative, '/'-separated
    sha256: str
    size: int


@dataclass(frozen=True)
class ModelArtifact:
    """A model's tree of files as a deploy published it."""

    model: str
    digest: str  # sha256 of the listing (see tree_digest)
    files: tuple[ArtifactFile, ...]
    path: str  # the model's ONNX file, in the tree
    variants: Mapping[str, str] = field(default_factory=dict)  # provider -> file in the tree
    version: str = ""  # the YAML's version, else the digest prefix

    @property
    def short(self) -> str:
        return self.digest[:SHORT]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        return f"{self.model}@{self.version} (sha256 {self.short}, {_mib(self.size)})"

    def side_files(self) -> ModelArtifact | None:
        """The files read beside the model's ONNX file (a decoder's config and tokenizer
        files) as a tree of their own, or None when there are none: what a caller that
        tokenizes needs of a model it has no copy of."""
        folder = posixpath.dirname(self.path)
        side = tuple(
            f for f in self.files if f.name in {posixpath.join(folder, n) for n in SIDE_FILES}
        )
        if not side:
            return None
        return replace(self, digest=tree_digest(side), files=side, variants={})


def sha256_file(path: Path) -> str:
    """The sha256 of ``path``'s bytes, read a chunk at a time."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(files: tuple[ArtifactFile, ...]) -> str:
    """The name of a tree: the sha256 of its sorted listing (name, sha256, size)."""
    listing = json.dumps([[f.name, f.sha256, f.size] for f in sorted(files, key=_by_name)])
    return hashlib.sha256(listing.encode()).hexdigest()


def model_files(name: str, path: Path, variants: Mapping[str, Path], kind: str) -> dict[str, Path]:
    """Every file a node reads to load a model, by its name in the model's tree: the
    ONNX file and each variant, the external-data files each references, and (for a
    decoder) the side files present. The tree's root is the files' common folder.
    ConfigError names a missing file."""
    onnx_files = [path, *variants.values()]
    found: set[Path] = set()
    for f in onnx_files:
        if not f.is_file():
            raise ConfigError(f"model {name!r}: {f} is not a file")
        found.add(f.resolve())
        found.update(_external_data(name, f))
    if kind == "decoder":
        for side in SIDE_FILES:
            candidate = path.parent / side
            if candidate.is_file():
                found.add(candidate.resolve())
    root = Path(os.path.commonpath([str(f.parent) for f in found]))
    return {f.relative_to(root).as_posix(): f for f in sorted(found)}


def describe_files(
    name: str,
    path: Path,
    variants: Mapping[str, Path],
    kind: str,
    version: str | None = None,
) -> tuple[ModelArtifact, dict[str, Path]]:
    """The artifact of a model's files (hashing each) and where each file is here."""
    files = model_files(name, path, variants, kind)
    listed = tuple(ArtifactFile(n, sha256_file(p), p.stat().st_size) for n, p in files.items())
    digest = tree_digest(listed)
    by_path = {p: n for n, p in files.items()}
    artifact = ModelArtifact(
        model=name,
        digest=digest,
        files=listed,
        path=by_path[path.resolve()],
        variants={k: by_path[v.resolve()] for k, v in variants.items()},
        version=version or digest[:SHORT],
    )
    return artifact, files


def split_version(model: str) -> tuple[str, str | None]:
    """``name@version`` -> (name, version); a name alone -> (name, None)."""
    name, at, version = model.partition("@")
    return (name, version) if at and version else (model, None)


def _external_data(name: str, path: Path) -> Iterator[Path]:
    """The external-data files ``path``'s tensors reference (read without loading them)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX: the load check names it (cluster/modelfiles.py)
        return
    seen: set[Path] = set()
    for tensor in _tensors(model.graph):
        if not uses_external_data(tensor):
            continue
        location = ExternalDataInfo(tensor).location
        file = (path.parent / location).resolve()
        if file in seen:
            continue
        seen.add(file)
        if not file.is_file():
            raise ConfigError(
                f"model {name!r}: {path} keeps tensor data in {location}, which is not "
                f"beside it ({file})"
            )
        yield file


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of an ONNX graph: initializers and attribute tensors, subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _by_name(f: ArtifactFile) -> str:
    return f.name


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
