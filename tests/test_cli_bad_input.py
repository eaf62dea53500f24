"""Bad input and documented defaults at the driver: one line, no traceback, and the defaults work."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner


def test_flash_check_defaults_leave_passages_on_a_default_sized_corpus(tmp_path: Path):
    from reliability_run import cli, make_run

    run = make_run(tmp_path, n_train_pairs=16)  # the embedded small corpus: 16 train pairs per concept
    doc = json.loads((run / "results.json").read_text())
    for cell in doc["cells"]:
        cell["n_train"] = 32
    (run / "results.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(cli(), ["flash-check", "--run", str(run), "--n-bootstrap", "50"])
    assert result.exit_code == 0, result.output
    assert "skipped fractions 1/64" in result.output  # 16 x 1/64 rounds to no pair at all
    fractions = [r["fraction"] for r in json.loads((run / "flash_check.json").read_text())["fractions"]]
    assert fractions == ["1/2", "1/4", "1/8", "1/16", "1/32"]
