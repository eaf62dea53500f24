"""Provenance: versions, git hash and date that results.json carries beside every number."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import poolbench

TRACKED_PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "scipy", "scikit-learn", "statsmodels",
                    "pyarrow", "ray", "spacy", "minio")


def package_versions() -> dict[str, str]:
    versions = {"poolbench": poolbench.__version__, "python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_hash(repo: Path | None = None) -> str | None:
    """The commit the code ran from, with '-dirty' when the tree has uncommitted changes; None outside git."""
    where = repo or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
