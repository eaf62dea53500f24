"""A corrupt artifact is quarantined and recomputed, never read and never blocking: check, intact, verify."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from test_store import flip_a_byte

from poolbench.store.artifact_store import ArtifactStore

KEY = "pooled/0123abcd"


def test_check_names_what_is_wrong(artifact_store: ArtifactStore) -> None:
    artifact_store.put_table(KEY, pa.table({"x": list(range(50))}))
    assert artifact_store.check(KEY) is None
    assert artifact_store.check("pooled/absent") == "missing"
    flip_a_byte(artifact_store, f"{KEY}.arrow")
    assert artifact_store.check(KEY).startswith("sha256 mismatch")


def test_intact_quarantines_a_corrupt_artifact_so_it_can_be_recomputed(artifact_store: ArtifactStore) -> None:
    artifact_store.put_json(KEY, {"auroc": 0.9})
    artifact_store.put_json("d1/healthy", {"auroc": 0.7})
    flip_a_byte(artifact_store, f"{KEY}.json")
    assert artifact_store.intact("d1/healthy")
    assert not artifact_store.intact(KEY)
    assert not artifact_store.exists(KEY)  # out of the way: a rerun writes it afresh
    assert artifact_store.quarantined == [(KEY, artifact_store.quarantined[0][1])]
    assert artifact_store.quarantined[0][1].startswith("sha256 mismatch")
    assert artifact_store.check(f"quarantine/{KEY}") is None  # kept for inspection, under its own checksum
    assert artifact_store.get_metadata(f"quarantine/{KEY}")["quarantined_because"].startswith("sha256 mismatch")
    artifact_store.put_json(KEY, {"auroc": 0.9})
    assert artifact_store.intact(KEY) and artifact_store.get_json("d1/healthy") == {"auroc": 0.7}


def test_a_missing_artifact_is_not_quarantined(artifact_store: ArtifactStore) -> None:
    assert not artifact_store.intact(KEY)
    assert artifact_store.quarantined == []


def test_a_corrupt_directory_vanishes_whole(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"a": 1}')
    (src / "weights.bin").write_bytes(b"w" * 4096)
    artifact_store.put_dir("models/tiny", src)
    flip_a_byte(artifact_store, "models/tiny.dir/weights.bin")
    assert artifact_store.check("models/tiny") == "sha256 mismatch in file weights.bin"
    assert not artifact_store.intact("models/tiny")
    assert not artifact_store.exists("models/tiny")
    assert artifact_store.list("models") == []


def test_verify_lists_every_bad_artifact_and_quarantines_on_request(artifact_store: ArtifactStore) -> None:
    for i in range(3):
        artifact_store.put_bytes(f"pooled/{i}", bytes([i]) * 100)
    flip_a_byte(artifact_store, "pooled/1.bin")
    assert [k for k, _ in artifact_store.verify("pooled")] == ["pooled/1"]
    assert artifact_store.exists("pooled/1")  # a plain verify only reports
    assert [k for k, _ in artifact_store.verify("pooled", quarantine=True)] == ["pooled/1"]
    assert artifact_store.verify() == []
    assert artifact_store.list("pooled") == ["pooled/0", "pooled/2"]


def test_store_verify_command_reports_then_quarantines(tmp_path: Path) -> None:
    import subprocess
    import sys

    from poolbench.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    store.put_bytes("pooled/good", b"g" * 64)
    store.put_bytes("pooled/bad", b"b" * 64)
    flip_a_byte(store, "pooled/bad.bin")
    cmd = [sys.executable, "-c", "from poolbench.cli.app import main; main()", "store", "verify",
           "--store", str(tmp_path / "store")]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 1
    assert "corrupt: pooled/bad (sha256 mismatch" in first.stdout and "1 of 2 artifacts whole" in first.stdout
    assert first.stderr.strip().splitlines() == [
        "error: 1 corrupt artifact(s): rerun with --quarantine to move them aside"]
    second = subprocess.run([*cmd, "--quarantine"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "quarantined: pooled/bad" in second.stdout
    assert LocalStore(tmp_path / "store").list("pooled") == ["pooled/good"]
