"""Models as content-addressed artifacts and a device's model cache, without Ray: the
store is a folder of files by digest here (cluster/store.py serves the same chunks)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from actors.cache import ArtifactError, ModelCache, file_source, in_tree
from edgefleet.artifacts import describe_files, sha256_file, split_version
from edgefleet.config import ModelConfig
from edgefleet.errors import ConfigError
from edgefleet.modelgen import make_classifier, make_detector, make_tiny_lm


def _external(tmp_path: Path) -> Path:
    """A classifier whose weights live in an external-data file beside it."""
    src = make_classifier(tmp_path / "inline.onnx")
    model = onnx.load(str(src))
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    return folder / "model.onnx"


def _source_of(*files: dict[str, Path]):
    by_digest = {sha256_file(p): p for f in files for p in f.values()}
    return file_source(by_digest, chunk_bytes=4096)


class CountingSource:
    def __init__(self, inner):
        self.inner, self.bytes = inner, 0

    def chunks(self, sha256: str, size: int) -> Iterator[bytes]:
        for chunk in self.inner.chunks(sha256, size):
            self.bytes += len(chunk)
            yield chunk


def test_a_models_files_are_its_onnx_file_its_external_data_and_a_decoders_side_files(tmp_path):
    path = _external(tmp_path)
    artifact, files = describe_files("c", path, {}, "tensor")
    assert sorted(files) == ["model.onnx", "model.onnx.data"]
    assert artifact.path == "model.onnx"
    assert artifact.version == artifact.digest[:12]
    again, _ = describe_files("c", path, {}, "tensor", version="v1")
    assert again.digest == artifact.digest and again.version == "v1"

    lm = make_tiny_lm(tmp_path / "lm" / "model.onnx")
    (lm.parent / "tokenizer.json").write_text("{}")
    (lm.parent / "notes.txt").write_text("not read by a node")
    lm_artifact, lm_files = describe_files("lm", lm, {}, "decoder")
    assert sorted(lm_files) == ["model.onnx", "tokenizer.json"]
    as_tensor, _ = describe_files("lm", lm, {}, "tensor")
    assert [f.name for f in as_tensor.files] == ["model.onnx"]


def test_a_variant_elsewhere_roots_the_tree_at_the_common_folder(tmp_path):
    cpu = make_classifier(tmp_path / "cpu" / "c.onnx")
    ov = make_detector(tmp_path / "ov" / "c.onnx")
    artifact, files = describe_files("c", cpu, {"OpenVINOExecutionProvider": ov}, "tensor")
    assert artifact.path == "cpu/c.onnx"
    assert artifact.variants == {"OpenVINOExecutionProvider": "ov/c.onnx"}


def test_a_missing_external_data_file_is_a_config_error_naming_it(tmp_path):
    path = _external(tmp_path)
    (path.parent / "model.onnx.data").unlink()
    with pytest.raises(ConfigError, match=r"model\.onnx\.data"):
        describe_files("c", path, {}, "tensor")


def test_a_model_is_fetched_once_and_loads_from_its_tree(tmp_path):
    path = _external(tmp_path)
    artifact, files = describe_files("c", path, {}, "tensor")
    source = CountingSource(_source_of(files))
    cache = ModelCache(tmp_path / "cache", limit_bytes=1 << 30)
    done = cache.ensure(artifact, source)
    assert done.bytes_fetched == artifact.size == source.bytes
    for f in artifact.files:
        assert sha256_file(done.tree / f.name) == f.sha256
    config = in_tree(ModelConfig(path=path), artifact, done.tree)
    assert config.path == done.tree / "model.onnx"
    import onnxruntime as ort

    ort.InferenceSession(str(config.path))  # its external data is found beside it

    # Another node on the device (a new process: nothing verified yet) fetches nothing.
    again = ModelCache(tmp_path / "cache", limit_bytes=1 << 30).ensure(artifact, source)
    assert again.bytes_fetched == 0 and source.bytes == artifact.size


def test_a_corrupted_cache_file_is_detected_and_fetched_again(tmp_path):
    path = _external(tmp_path)
    artifact, files = describe_files("c", path, {}, "tensor")
    source = CountingSource(_source_of(files))
    root = tmp_path / "cache"
    tree = ModelCache(root, 1 << 30).ensure(artifact, source).tree
    data = tree / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped
    data.write_bytes(bytes(raw))

    done = ModelCache(root, 1 << 30).ensure(artifact, source)  # a restarted node
    assert done.refetched == 1 and done.files_fetched == 1
    assert sha256_file(done.tree / "model.onnx.data") == sha256_file(path.parent / data.name)


def test_a_truncated_file_is_seen_even_once_verified(tmp_path):
    path = _external(tmp_path)
    artifact, files = describe_files("c", path, {}, "tensor")
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    tree = cache.ensure(artifact, _source_of(files)).tree
    with (tree / "model.onnx").open("r+b") as fh:
        fh.truncate(10)
    done = cache.ensure(artifact, _source_of(files))
    assert done.refetched == 1
    assert sha256_file(done.tree / "model.onnx") == sha256_file(path)


def test_bytes_unlike_their_digest_are_refused_and_nothing_is_kept(tmp_path):
    path = make_classifier(tmp_path / "c.onnx")
    artifact, _ = describe_files("c", path, {}, "tensor")
    other = make_detector(tmp_path / "d.onnx")
    lying = file_source({artifact.files[0].sha256: other})
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(ArtifactError, match="expected"):
        cache.ensure(artifact, lying)
    assert list((cache.root / "blobs").iterdir()) == []
    assert list((cache.root / "tmp").iterdir()) == []


def _age(cache: ModelCache, seconds: float) -> None:
    old = time.time() - seconds
    for sub in ("trees", "blobs"):
        for p in (cache.root / sub).iterdir():
            os.utime(p, (old, old))


def _two_models(tmp_path: Path):
    """Two models' artifacts (a classifier, a detector) and a source of their files."""
    a, a_files = describe_files("a", make_classifier(tmp_path / "a" / "m.onnx"), {}, "tensor")
    b, b_files = describe_files("b", make_detector(tmp_path / "b" / "m.onnx"), {}, "tensor")
    return a, b, _source_of(a_files, b_files)


def test_past_its_limit_the_cache_removes_the_least_recently_used_model_not_one_in_use(tmp_path):
    a, b, source = _two_models(tmp_path)
    cache = ModelCache(tmp_path / "cache", limit_bytes=max(a.size, b.size) + 1)
    cache.ensure(a, source)
    _age(cache, 3600)
    # b in use and a too: over the limit, nothing may go.
    cache.ensure(b, source, keep=[a.digest])
    assert cache.tree(a).is_dir() and cache.tree(b).is_dir()
    cache.ensure(b, source)  # a no longer in use: it goes, blobs and all
    assert not cache.tree(a).exists() and cache.tree(b).is_dir()
    assert cache.size() == b.size


def test_a_model_another_node_used_just_now_is_not_evicted(tmp_path):
    a, b, source = _two_models(tmp_path)
    cache = ModelCache(tmp_path / "cache", limit_bytes=1)
    cache.ensure(a, source)
    cache.ensure(b, source)
    assert cache.tree(a).is_dir()  # used within EVICT_MIN_AGE_S


def test_model_at_version_names_a_version():
    assert split_version("detector@v2") == ("detector", "v2")
    assert split_version("detector") == ("detector", None)
    assert split_version("detector@") == ("detector@", None)


def test_the_store_keeps_a_blob_only_when_its_bytes_match_and_drops_what_no_publish_holds(
    tmp_path, monkeypatch
):
    from dataclasses import asdict

    from cluster.store import ModelStore

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = ModelStore("f")
    v1, v1_files = describe_files("c", make_classifier(tmp_path / "v1" / "c.onnx"), {}, "tensor")
    data = v1_files["c.onnx"].read_bytes()
    digest = v1.files[0].sha256
    assert store.missing([digest]) == [digest]
    half = len(data) // 2
    store.write(digest, half, data[half:])  # chunks may come in any order
    store.write(digest, 0, data[:half])
    store.commit(digest, len(data))
    assert store.missing([digest]) == []
    assert store.read(digest, 10, 5).tobytes() == data[10:15]

    with pytest.raises(ValueError, match="another digest"):
        store.write("0" * 64, 0, b"not those bytes")
        store.commit("0" * 64, 15)
    assert store.missing(["0" * 64]) == ["0" * 64]

    store.publish({"c": asdict(v1)})
    v2, v2_files = describe_files("c", make_detector(tmp_path / "v2" / "c.onnx"), {}, "tensor")
    d2 = v2.files[0].sha256
    store.write(d2, 0, v2_files["c.onnx"].read_bytes())
    store.commit(d2, v2.files[0].size)
    assert store.publish({"c": asdict(v2)}) == 0  # v1 is the one published before: kept
    v3, v3_files = describe_files("c", _external(tmp_path), {}, "tensor")
    assert store.publish({"c": asdict(v3)}) == v1.size  # v1 is two publishes old
    assert store.missing([digest, d2]) == [digest]
