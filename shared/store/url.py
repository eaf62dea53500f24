"""Where a store URL leads: a local folder, or an S3 bucket (credentials from the environment)."""

from __future__ import annotations

import os
import re

from poolbench.defaults import default_store_url
from poolbench.errors import StoreError
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.local import LOCAL_PREFIX, LocalStore
from poolbench.store.s3 import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, DEFAULT_RETRIES, S3Store


def open_store(url: str | os.PathLike[str] | None = None) -> ArtifactStore:
    """A store from a CLI/config value: None -> the default folder, a folder -> LocalStore;
    ``s3://bucket/prefix`` -> S3Store, configured from POOLBENCH_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_REGION."""
    if url is None:
        return LocalStore(default_store_url())
    text = os.fspath(url)
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError(f"store URL {text!r} has no bucket: use s3://bucket/prefix")
        endpoint = _required_env("POOLBENCH_S3_ENDPOINT", "the S3 endpoint URL, e.g. http://127.0.0.1:9000")
        access_key = _required_env("AWS_ACCESS_KEY_ID", "the S3 access key")
        secret_key = _required_env("AWS_SECRET_ACCESS_KEY", "the S3 secret key")
        region = os.environ.get("AWS_REGION") or "us-east-1"
        return S3Store(bucket, prefix, endpoint, access_key=access_key, secret_key=secret_key, region=region,
                       connect_timeout_s=_number_env("POOLBENCH_S3_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S),
                       read_timeout_s=_number_env("POOLBENCH_S3_READ_TIMEOUT", DEFAULT_READ_TIMEOUT_S),
                       retries=int(_number_env("POOLBENCH_S3_RETRIES", DEFAULT_RETRIES)))
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :])
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise StoreError(f"unsupported store URL {text!r}: use a folder path or s3://bucket/prefix")
    return LocalStore(text)


def _number_env(var: str, default: float) -> float:
    text = os.environ.get(var)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise StoreError(f"{var}={text!r} is not a number") from None
    if value < 0:
        raise StoreError(f"{var}={text!r} must be >= 0")
    return value


def _required_env(var: str, what: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise StoreError(f"{var} is not set: an s3:// store needs it ({what})")
    return value


def run_store_url(run: dict) -> str:
    """The store a finished run used, from its results.json: the absolute folder a local run recorded (its --store
    may have been relative to where it ran, or unset: the default of the machine and POOLBENCH_CACHE it ran with),
    else its --store (an S3 URL, reached with this environment's endpoint and keys)."""
    recorded = str(run.get("store") or "")
    if recorded.startswith(LOCAL_PREFIX):
        return recorded[len(LOCAL_PREFIX):]
    configured = (run.get("config") or {}).get("store")
    if configured:
        return str(configured)
    if recorded.startswith("s3://"):  # S3Store.describe(): "s3://bucket/prefix @ endpoint"
        return recorded.partition(" @ ")[0]
    return default_store_url()  # a run written before results.json recorded its store


def open_run_store(run: dict) -> ArtifactStore:
    """The artifact store a finished run wrote to (run_store_url), for every command that reads a run's artifacts."""
    return open_store(run_store_url(run))
