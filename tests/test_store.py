"""The artifact store contract (run on LocalStore and S3Store), local atomicity, and artifact keys."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from arrow_bytes import library_ipc_bytes
from minio import Minio
from pydantic import BaseModel
from s3_server import ACCESS_KEY, REGION, SECRET_KEY

from poolbench.errors import PoolBenchError, StoreError
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key, canonical_json, hash_directory, sha256_file
from poolbench.store.local import SIDECAR_SUFFIX, LocalStore
from poolbench.store.url import open_store

KEY = "pooled/0123abcd"


def raw_client(store: ArtifactStore) -> Minio:
    host = store.endpoint.split("://", 1)[1]
    return Minio(host, access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region=REGION)


def flip_a_byte(store: ArtifactStore, name: str) -> None:
    """Bit rot: change one byte of a stored object but keep its recorded checksum."""
    if isinstance(store, LocalStore):
        path = store.root / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        return
    client, obj = raw_client(store), store.prefix + name
    sha = client.stat_object(store.bucket, obj).metadata["x-amz-meta-poolbench-sha256"]
    response = client.get_object(store.bucket, obj)
    data = bytearray(response.read())
    response.close()
    data[len(data) // 2] ^= 0x01
    meta = {"poolbench-sha256": sha}
    client.put_object(store.bucket, obj, io.BytesIO(bytes(data)), len(data), metadata=meta)


def make_model_dir(root: Path) -> Path:
    d = root / "model"
    (d / "tokenizer").mkdir(parents=True)
    (d / "config.json").write_text('{"n_layers": 2}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (d / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    return d


# ---- the shared contract, once per backend ----


def test_bytes_round_trip_keeps_metadata(artifact_store: ArtifactStore) -> None:
    assert not artifact_store.exists(KEY)
    artifact_store.put_bytes(KEY, b"\x00\xffpool", metadata={"model": "gpt2", "note": "café"})
    assert artifact_store.exists(KEY)
    assert artifact_store.get_bytes(KEY) == b"\x00\xffpool"
    assert artifact_store.get_metadata(KEY) == {"model": "gpt2", "note": "café"}


def test_json_round_trip(artifact_store: ArtifactStore) -> None:
    doc = {"auroc": 0.8125, "layers": [0, 3], "concept": "négation", "ok": True, "none": None}
    artifact_store.put_json("d1/abc", doc)
    assert artifact_store.get_json("d1/abc") == doc
    assert artifact_store.get_metadata("d1/abc") == {}


def test_json_rejects_nan(artifact_store: ArtifactStore) -> None:
    with pytest.raises(StoreError, match="d1/nan"):
        artifact_store.put_json("d1/nan", {"x": float("nan")})
    assert not artifact_store.exists("d1/nan")


def test_table_round_trip_with_provenance_in_schema(artifact_store: ArtifactStore) -> None:
    table = pa.table({"id": ["p1", "p2"], "v": pa.array([[0.5, -1.0], [2.0, 0.25]], pa.list_(pa.float32()))})
    table = table.replace_schema_metadata({"origin": "pooler"})
    artifact_store.put_table(KEY, table, metadata={"weights": "ab12", "layer": "3"})
    back = artifact_store.get_table(KEY)
    assert back.column("id").to_pylist() == ["p1", "p2"]
    assert back.column("v").to_pylist() == [[0.5, -1.0], [2.0, 0.25]]
    assert back.schema.metadata == {b"origin": b"pooler", b"weights": b"ab12", b"layer": b"3"}
    assert artifact_store.get_metadata(KEY) == {"weights": "ab12", "layer": "3"}


@pytest.mark.parametrize("shape", ["chunked", "empty", "one-row"])
def test_a_table_serialises_to_the_librarys_bytes_in_one_exact_buffer(shape: str) -> None:
    """table_to_ipc_bytes sizes its buffer with a counting pass: the bytes are pyarrow's own, byte for byte (so
    every stored checksum stays as it was), for several record batches, strings, nulls, fixed-size lists and
    schema metadata; a read-only view, round-tripping through ipc_bytes_to_table."""
    from poolbench.store.arrow_tables import ipc_bytes_to_table, table_to_ipc_bytes

    vectors = pa.FixedSizeListArray.from_arrays(pa.array([float(i) / 7 for i in range(30)], pa.float32()), 3)
    whole = pa.table({"id": [f"p{i}" if i % 4 else None for i in range(10)], "v": vectors},
                     metadata={"poolbench.concept": "tone"})
    table = {"chunked": pa.concat_tables([whole.slice(0, 3), whole.slice(3, 6), whole.slice(9)]),
             "empty": whole.slice(0, 0), "one-row": whole.slice(4, 1)}[shape]
    view = table_to_ipc_bytes(table)
    assert view.readonly and bytes(view) == library_ipc_bytes(table)
    assert ipc_bytes_to_table(view).equals(table)
    assert hashlib.sha256(view).hexdigest() == hashlib.sha256(library_ipc_bytes(table)).hexdigest()


def test_a_table_is_stored_as_the_librarys_bytes_in_every_backend(artifact_store: ArtifactStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder store writes a table straight into its file, an S3 store into a spool file it uploads (no
    serialised copy in memory either way: a layer's shard of an 8B model is GBs): the object is pyarrow's IPC file,
    byte for byte, with the schema's provenance, and its recorded sha256 is those bytes' (so a key's object is the
    same whichever store holds it)."""
    from poolbench.store import artifact_store as base
    from poolbench.store.arrow_tables import with_provenance

    vectors = pa.FixedSizeListArray.from_arrays(pa.array([float(i) / 3 for i in range(24)], pa.float32()), 4)
    whole = pa.table({"id": [f"p{i}" for i in range(6)], "v": vectors})
    table = pa.concat_tables([whole.slice(0, 2), whole.slice(2, 4)])
    want = library_ipc_bytes(with_provenance(table, {"layer": "3"}))
    monkeypatch.setattr(base, "table_to_ipc_bytes", lambda t: pytest.fail("serialised in memory"))
    assert artifact_store.buffers_tables is False  # what the host fit counts (driver/host_room.py)
    artifact_store.put_table(KEY, table, metadata={"layer": "3"})
    stored = artifact_store._read(f"{KEY}.arrow")
    assert stored is not None and bytes(stored.data) == want
    assert stored.sha256 == hashlib.sha256(want).hexdigest()
    assert artifact_store.get_table(KEY).equals(with_provenance(table, {"layer": "3"}))


def test_overwrite_replaces(artifact_store: ArtifactStore) -> None:
    artifact_store.put_bytes(KEY, b"one")
    artifact_store.put_bytes(KEY, b"two", metadata={"v": "2"})
    assert artifact_store.get_bytes(KEY) == b"two"
    assert artifact_store.get_metadata(KEY) == {"v": "2"}


def test_dir_round_trip(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    src = make_model_dir(tmp_path)
    artifact_store.put_dir("models/tiny", src, metadata={"model_id": "tiny"})
    assert artifact_store.exists("models/tiny")
    assert artifact_store.list("models/") == ["models/tiny"]  # files inside are not keys
    out = artifact_store.get_dir("models/tiny", tmp_path / "fetched" / "tiny")
    assert out == tmp_path / "fetched" / "tiny"
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert got == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    assert (out / "model.safetensors").read_bytes() == bytes(range(256)) * 40
    assert hash_directory(out) == hash_directory(src)
    assert artifact_store.get_metadata("models/tiny") == {"model_id": "tiny"}
    with pytest.raises(StoreError, match="not an empty folder"):
        artifact_store.get_dir("models/tiny", out)


def test_dir_rewrite_drops_stale_files(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    src = make_model_dir(tmp_path)
    artifact_store.put_dir("models/tiny", src)
    (src / "tokenizer" / "vocab.txt").unlink()
    (src / "config.json").write_text('{"n_layers": 3}')
    artifact_store.put_dir("models/tiny", src)
    out = artifact_store.get_dir("models/tiny", tmp_path / "out")
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"n_layers": 3}'


def test_dir_without_manifest_does_not_exist(
    artifact_store: ArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload interrupted before the manifest leaves no artifact, only invisible leftovers."""
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("killed before the manifest")

    monkeypatch.setattr(artifact_store, "_write", crash)
    with pytest.raises(RuntimeError):
        artifact_store.put_dir("models/tiny", make_model_dir(tmp_path))
    monkeypatch.undo()
    assert not artifact_store.exists("models/tiny")
    assert artifact_store.list() == []
    with pytest.raises(StoreError, match="models/tiny not found"):
        artifact_store.get_dir("models/tiny", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    artifact_store.delete("models/tiny")  # removes the leftovers


def test_dir_corruption_detected_and_nothing_fetched(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    artifact_store.put_dir("models/tiny", make_model_dir(tmp_path))
    flip_a_byte(artifact_store, "models/tiny.dir/model.safetensors")
    with pytest.raises(StoreError, match=r"tiny is corrupt \(sha256 mismatch\) in file model.safetensors"):
        artifact_store.get_dir("models/tiny", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


@pytest.mark.parametrize(("put", "get", "name"), [
    ("put_bytes", "get_bytes", f"{KEY}.bin"),
    ("put_table", "get_table", f"{KEY}.arrow"),
    ("put_json", "get_json", f"{KEY}.json"),
])
def test_corruption_detected(artifact_store: ArtifactStore, put: str, get: str, name: str) -> None:
    value = {"put_bytes": b"0123456789" * 10, "put_table": pa.table({"x": list(range(50))}),
             "put_json": {"xs": list(range(50))}}[put]
    getattr(artifact_store, put)(KEY, value)
    flip_a_byte(artifact_store, name)
    with pytest.raises(StoreError, match=rf"^artifact {KEY} is corrupt \(sha256 mismatch\)"):
        getattr(artifact_store, get)(KEY)


def test_missing_key_names_it(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    for get in (artifact_store.get_bytes, artifact_store.get_json, artifact_store.get_table,
                artifact_store.get_metadata, artifact_store.delete):
        with pytest.raises(StoreError, match=r"^artifact nothing/here not found in "):
            get("nothing/here")
    with pytest.raises(StoreError, match="nothing/here"):
        artifact_store.get_dir("nothing/here", tmp_path / "x")


def test_wrong_kind_says_what_it_is(artifact_store: ArtifactStore) -> None:
    artifact_store.put_json(KEY, [1])
    with pytest.raises(StoreError, match=rf"artifact {KEY} in .* is stored as json, not table"):
        artifact_store.get_table(KEY)


def test_list_and_delete(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    artifact_store.put_bytes("pooled/aa", b"1")
    artifact_store.put_json("pooled/ab", {})
    artifact_store.put_table("d1/aa", pa.table({"x": [1]}))
    artifact_store.put_dir("models/m", make_model_dir(tmp_path))
    assert artifact_store.list() == ["d1/aa", "models/m", "pooled/aa", "pooled/ab"]
    assert artifact_store.list("pooled/") == ["pooled/aa", "pooled/ab"]
    assert artifact_store.list("pooled/aa") == ["pooled/aa"]
    assert artifact_store.list("po") == ["pooled/aa", "pooled/ab"]
    assert artifact_store.list("nope/") == []
    artifact_store.delete("pooled/aa")
    artifact_store.delete("models/m")
    assert artifact_store.list() == ["d1/aa", "pooled/ab"]
    assert not artifact_store.exists("models/m")
    assert not artifact_store.exists("pooled/aa")


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a/b.arrow", "a//b", "a/", "ä"])
def test_invalid_keys_rejected(artifact_store: ArtifactStore, bad: str) -> None:
    with pytest.raises(StoreError, match="invalid artifact key"):
        artifact_store.put_bytes(bad, b"x")


def test_metadata_must_be_strings(artifact_store: ArtifactStore) -> None:
    with pytest.raises(StoreError, match="'layer'"):
        artifact_store.put_bytes(KEY, b"x", metadata={"layer": 3})  # type: ignore[dict-item]


# ---- LocalStore specifics ----


def test_local_layout(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_table("pooled/ab", pa.table({"x": [1]}))
    store.put_json("d1/ab", {})
    store.put_bytes("raw/ab", b"x")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["d1/ab.json", f"d1/ab.json{SIDECAR_SUFFIX}", "pooled/ab.arrow",
                     f"pooled/ab.arrow{SIDECAR_SUFFIX}", "raw/ab.bin", f"raw/ab.bin{SIDECAR_SUFFIX}"]
    side = json.loads((tmp_path / f"raw/ab.bin{SIDECAR_SUFFIX}").read_text())
    assert side == {"sha256": hashlib.sha256(b"x").hexdigest(), "metadata": {}}
    with pa.ipc.open_file(tmp_path / "pooled/ab.arrow") as reader:  # plain Arrow IPC on disk
        assert reader.read_all().column("x").to_pylist() == [1]
    assert store.describe() == f"local:{tmp_path}"


@pytest.mark.parametrize("fail_on", ["sidecar", "content"])
def test_local_crash_mid_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_on: str
) -> None:
    store = LocalStore(tmp_path)
    real_replace = os.replace

    def crashing_replace(src: str, dst: str) -> None:
        if str(dst).endswith(SIDECAR_SUFFIX) == (fail_on == "sidecar"):
            raise RuntimeError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(RuntimeError, match="power cut"):
        store.put_table(KEY, pa.table({"x": [1, 2, 3]}))
    monkeypatch.undo()
    assert not store.exists(KEY)
    assert store.list() == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no temp file, no orphan sidecar


def test_local_crash_mid_rewrite_keeps_old_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes(KEY, b"old", metadata={"v": "1"})
    real_replace = os.replace

    def crashing_replace(src: str, dst: str) -> None:
        if str(dst).endswith(".bin"):
            raise RuntimeError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(RuntimeError):
        store.put_bytes(KEY, b"new", metadata={"v": "2"})
    monkeypatch.undo()
    assert store.get_bytes(KEY) == b"old"
    assert store.get_metadata(KEY) == {"v": "1"}
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 2


def test_local_missing_sidecar_is_corrupt(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes(KEY, b"x")
    (tmp_path / f"{KEY}.bin{SIDECAR_SUFFIX}").unlink()
    with pytest.raises(StoreError, match="corrupt"):
        store.get_bytes(KEY)


def test_local_tampered_manifest_cannot_escape(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_dir("models/m", make_model_dir(tmp_path))
    manifest_path = tmp_path / "s/models/m.dir/MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["../../evil"] = manifest["files"].pop("config.json")
    data = json.dumps(manifest).encode()
    store._write("models/m.dir/MANIFEST.json", data, hashlib.sha256(data).hexdigest(), {})
    with pytest.raises(StoreError, match="unsafe path"):
        store.get_dir("models/m", tmp_path / "out")
    assert not (tmp_path / "evil").exists()


def test_open_store_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "cache"))
    default = open_store(None)
    assert isinstance(default, LocalStore)
    assert default.root == tmp_path / "cache" / "store"
    assert open_store(str(tmp_path / "a")).describe() == f"local:{tmp_path / 'a'}"
    assert open_store(f"file://{tmp_path / 'b'}").describe() == f"local:{tmp_path / 'b'}"
    with pytest.raises(StoreError, match="unsupported store URL 'gs://x'"):
        open_store("gs://x")


def test_store_error_is_a_poolbench_error() -> None:
    assert issubclass(StoreError, PoolBenchError)


# ---- keys ----


def test_artifact_key_hand_computed() -> None:
    expected = hashlib.sha256(b'{"layer":3,"model":"gpt2"}').hexdigest()[:32]
    assert artifact_key("pooled", model="gpt2", layer=3) == f"pooled/{expected}"
    assert canonical_json({"b": [1.5, None, True], "a": {"y": 1, "x": "é"}}) == (
        '{"a":{"x":"\\u00e9","y":1},"b":[1.5,null,true]}'
    )
    assert canonical_json(0.1) == "0.1"  # floats by repr


def test_artifact_key_ignores_order() -> None:
    a = artifact_key("d1", model="m", spec={"id": "mean", "params": {"k": 2, "p": 0.5}}, seed=0)
    b = artifact_key("d1", seed=0, spec={"params": {"p": 0.5, "k": 2}, "id": "mean"}, model="m")
    assert a == b
    assert artifact_key("d1", layers=(1, 2)) == artifact_key("d1", layers=[1, 2])


def test_artifact_key_changes_with_every_determinant() -> None:
    base = {"model": "gpt2", "weights": "ab12", "layers": [0, 6], "strategies": ["mean", "last"],
            "corpus": "c0ff", "version": 1, "seed": 0, "lr": 0.001}
    changed = {"model": "gpt2-medium", "weights": "ab13", "layers": [0, 7], "strategies": ["last", "mean"],
               "corpus": "c0fe", "version": 2, "seed": 1, "lr": 0.0011}
    keys = {artifact_key("pooled", **base)}
    for name, value in changed.items():
        keys.add(artifact_key("pooled", **{**base, name: value}))
    keys.add(artifact_key("pooled", **base, extra=None))
    keys.add(artifact_key("d1", **base))
    assert len(keys) == len(changed) + 3
    assert artifact_key("x", v=1) != artifact_key("x", v=1.0) != artifact_key("x", v=True)


def test_artifact_key_accepts_pydantic_models() -> None:
    class Spec(BaseModel):
        id: str
        k: int

    assert artifact_key("p", spec=Spec(id="mean", k=2)) == artifact_key("p", spec={"k": 2, "id": "mean"})


@pytest.mark.parametrize(
    "bad", [{"x": float("nan")}, {"x": float("inf")}, {"x": Path("a")}, {"x": {1: 2}}, {}]
)
def test_artifact_key_rejects_non_json_determinants(bad: dict) -> None:
    with pytest.raises(StoreError):
        artifact_key("k", **bad)


def test_sha256_file_known_value(tmp_path: Path) -> None:
    (tmp_path / "abc").write_bytes(b"abc")
    assert sha256_file(tmp_path / "abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    with pytest.raises(StoreError, match="missing"):
        sha256_file(tmp_path / "missing")


def test_hash_directory_is_stable_and_sensitive(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    listing = {"config.json": sha256_file(d / "config.json"),
               "model.safetensors": sha256_file(d / "model.safetensors"),
               "tokenizer/vocab.txt": sha256_file(d / "tokenizer/vocab.txt")}
    expected = hashlib.sha256(json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert hash_directory(d) == expected
    os.utime(d / "config.json", (1, 1))
    assert hash_directory(d) == expected  # mtimes do not matter
    weights_only = hash_directory(d, patterns=["*.safetensors"])
    (d / "tokenizer" / "vocab.txt").write_text("changed")
    assert hash_directory(d, patterns=["*.safetensors"]) == weights_only
    assert hash_directory(d) != expected
    (d / "model.safetensors").rename(d / "model2.safetensors")
    assert hash_directory(d, patterns=["*.safetensors"]) != weights_only  # names count
    with pytest.raises(StoreError, match=r"no files matching \['\*.gguf'\]"):
        hash_directory(d, patterns=["*.gguf"])


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_a_folder_stores_table_lies_in_its_file_mapped_into_memory(tmp_path: Path) -> None:
    """A D1 task's layer of an 8B model is ~1.7 GB: get_table maps the file instead of copying it, so the table's
    values lie inside the file's mapping (with read_bytes they lie in a private copy); rewritten under the same key,
    the old table keeps the file it mapped and the next read gets the new one."""
    store = LocalStore(tmp_path)
    table = pa.table({"v": pa.array(range(1 << 16), pa.float64())})
    store.put_table("t/a", table)
    got = store.get_table("t/a")
    assert got.equals(table)
    address = got.column("v").chunks[0].buffers()[1].address
    path = str(tmp_path / "t" / "a.arrow")
    spans = [line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
             if line.endswith(path)]
    assert any(int(low, 16) <= address < int(high, 16) for low, high in spans)
    store.put_table("t/a", pa.table({"v": pa.array([1.5, 2.5])}))
    assert got.equals(table) and store.get_table("t/a").column("v").to_pylist() == [1.5, 2.5]
