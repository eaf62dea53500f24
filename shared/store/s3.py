"""S3 backend of the artifact store (any S3-compatible server) via minio, failing fast and in one line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import certifi
import pyarrow as pa
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error

from poolbench.errors import StoreError
from poolbench.store.arrow_tables import map_file, write_ipc_file
from poolbench.store.artifact_store import SUFFIX_JSON, SUFFIX_TABLE, ArtifactStore, StoredObject
from poolbench.store.keys import sha256_file

logger = logging.getLogger(__name__)

META_SHA256 = "poolbench-sha256"
META_METADATA = "poolbench-metadata"
_MISSING_CODES = {"NoSuchKey", "NoSuchObject"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}
_CONTENT_TYPES = {SUFFIX_TABLE: "application/vnd.apache.arrow.file", SUFFIX_JSON: "application/json"}


DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_READ_TIMEOUT_S = 7.0  # between two reads of a reply, not for the whole transfer
DEFAULT_RETRIES = 2
BACKOFF_S = 0.1


def worst_case_s(connect_timeout_s: float, read_timeout_s: float, retries: int) -> float:
    """Every attempt connecting and then waiting its full read timeout, plus urllib3's backoff between them."""
    backoff = sum(min(BACKOFF_S * 2 ** (n - 1), 120.0) for n in range(2, retries + 1))  # urllib3: none before 2nd
    return (retries + 1) * (connect_timeout_s + read_timeout_s) + backoff


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _network_failure(exc: BaseException) -> str:
    """Say in a few words why the endpoint could not be used, from the exception chain urllib3 builds."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e):
            return "refused the connection"
        if isinstance(e, (TimeoutError, urllib3.exceptions.TimeoutError)):
            return "timed out"
        todo += [getattr(e, "reason", None), e.__cause__, e.__context__]
    return f"is unreachable ({_one_line(exc)[:200]})"


class S3Store(ArtifactStore):
    """Artifacts as objects ``<prefix><name>`` in one bucket; sha256 and metadata ride in object metadata.

    A single put_object is atomic on S3 (the object appears whole or not at all), and so is a multipart upload
    (the object appears when it completes; minio aborts one that fails); directory artifacts rely on their
    manifest being written last. The HTTP client retries only a couple of times with short timeouts, so a dead or
    hung endpoint fails within `worst_case_s` (under 30 s by default) instead of minutes.

    Tables are spooled: written into a temporary file in `spool_dir` (default: the system's, $TMPDIR), hashed
    from the page cache and uploaded from the file a part at a time, so no serialised copy of a table is held in
    memory (a pooling job's layer of an 8B model at the full corpus is GBs, and an extractor writes several at
    once: driver/host_room.py counts it so); a table is read back the same way, downloaded into the spool and
    mapped (_read_mapped). Where the spool cannot take a table, it goes through memory instead (the base class's
    way) and the log says so once.
    """

    buffers_tables = False  # spooled to a file and uploaded from it (_write_table)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str = "http://127.0.0.1:9000",
        access_key: str | None = None,
        secret_key: str | None = None,
        secure: bool | None = None,
        region: str = "us-east-1",
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.spool_dir = None if spool_dir is None else os.fspath(spool_dir)
        self._spool_failed = False
        self.connect_timeout_s, self.read_timeout_s, self.retries = connect_timeout_s, read_timeout_s, retries
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        if parts.scheme not in ("", "http", "https") or not parts.netloc or parts.path.strip("/"):
            raise StoreError(f"invalid S3 endpoint {endpoint!r}: use http(s)://host:port")
        self.secure = parts.scheme == "https" if parts.scheme else (True if secure is None else secure)
        self.endpoint = f"{'https' if self.secure else 'http'}://{parts.netloc}"
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            retries=urllib3.Retry(
                total=retries, backoff_factor=BACKOFF_S, status_forcelist=[500, 502, 503, 504]
            ),
            maxsize=10,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        )
        try:
            self._client = Minio(
                parts.netloc,
                access_key=access_key,
                secret_key=secret_key,
                secure=self.secure,
                region=region,
                http_client=http,
            )
        except ValueError as exc:
            raise StoreError(f"invalid S3 configuration for {endpoint}: {_one_line(exc)}") from exc
        with self._errors("checking the bucket"):
            try:
                found = self._client.bucket_exists(bucket)
            except ValueError as exc:
                raise StoreError(f"invalid S3 bucket name {bucket!r}: {_one_line(exc)}") from exc
        if not found:
            with self._errors("checking the bucket"):  # a HEAD 404 may come from a non-S3 server: ask again
                next(iter(self._client.list_objects(bucket)), None)  # S3 answers NoSuchBucket in XML
            raise StoreError(f"S3 bucket {bucket!r} does not exist at {self.endpoint}")

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} @ {self.endpoint}"

    @property
    def worst_case_s(self) -> float:
        """The longest one call can wait on an endpoint that accepts and never answers."""
        return worst_case_s(self.connect_timeout_s, self.read_timeout_s, self.retries)

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn SDK / network failures into one-line StoreErrors that name the endpoint or bucket."""
        try:
            yield
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                raise StoreError(f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}") from exc
            if exc.code in _AUTH_CODES:
                raise StoreError(
                    f"S3 endpoint {self.endpoint} denied {doing} ({exc.code}): "
                    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
                ) from exc
            raise StoreError(
                f"S3 error while {doing} at {self.endpoint}: {exc.code}: {_one_line(exc.message)}"
            ) from exc
        except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            raise StoreError(
                f"S3 endpoint {self.endpoint} {_network_failure(exc)} while {doing} after {self.retries + 1} "
                f"attempts (timeouts: connect {self.connect_timeout_s:g} s, read {self.read_timeout_s:g} s; is the "
                "server running?)"
            ) from exc
        except InvalidResponseError as exc:
            raise StoreError(
                f"S3 endpoint {self.endpoint} does not answer like an S3 server while {doing} "
                f"(HTTP {getattr(exc, '_code', '?')}, non-XML reply)"
            ) from exc
        except MinioException as exc:
            raise StoreError(
                f"S3 endpoint {self.endpoint} failed while {doing}: {_one_line(exc)[:200]}"
            ) from exc

    def _object(self, name: str) -> str:
        return self.prefix + name

    @staticmethod
    def _headers_to_info(headers: object, data: bytes = b"") -> StoredObject:
        get = getattr(headers, "get", None)
        sha = get(f"x-amz-meta-{META_SHA256}") if get else None
        raw = get(f"x-amz-meta-{META_METADATA}") if get else None
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            meta = {}
        return StoredObject(data, sha, {str(k): str(v) for k, v in meta.items()})

    @staticmethod
    def _object_metadata(sha256: str, metadata: dict[str, str] | None = None) -> dict[str, str]:
        out = {META_SHA256: sha256}
        if metadata is not None:
            out[META_METADATA] = json.dumps(metadata, sort_keys=True, ensure_ascii=True)
        return out

    def _write(self, name: str, data: bytes | memoryview, sha256: str, metadata: dict[str, str]) -> None:
        suffix = name[name.rfind(".") :]
        content_type = _CONTENT_TYPES.get(suffix, "application/octet-stream")
        with self._errors(f"writing {name}"):
            self._client.put_object(
                self.bucket,
                self._object(name),
                pa.BufferReader(data),  # read a part at a time from the caller's buffer: io.BytesIO copied it whole
                len(data),
                content_type=content_type,
                metadata=self._object_metadata(sha256, metadata),
            )

    def _write_table(self, name: str, table: pa.Table, metadata: dict[str, str]) -> None:
        """Spool, hash, upload (the class docstring says why); the uploaded bytes are the file's, the sha256 too."""
        with self._spool(name) as folder:
            if folder is not None:
                path = folder / "table.arrow"
                try:
                    write_ipc_file(table, path)
                    sha256 = sha256_file(path)
                except OSError as exc:  # no room, no permission: the table still goes, from memory
                    self._unspooled(name, exc)
                else:
                    with self._errors(f"writing {name}"):
                        self._client.fput_object(self.bucket, self._object(name), str(path),
                                                 content_type=_CONTENT_TYPES[SUFFIX_TABLE],
                                                 metadata=self._object_metadata(sha256, metadata))
                    return
        super()._write_table(name, table, metadata)

    @contextlib.contextmanager
    def _spool(self, name: str) -> Iterator[Path | None]:
        """A temporary folder in `spool_dir` for one object, removed after; None (said once) where none can be
        made, and the caller goes through memory."""
        try:
            spool = tempfile.TemporaryDirectory(dir=self.spool_dir, prefix="poolbench-s3-spool-")
        except OSError as exc:
            self._unspooled(name, exc)
            yield None
            return
        with spool as folder:
            yield Path(folder)

    def _unspooled(self, name: str, exc: OSError) -> None:
        if not self._spool_failed:
            self._spool_failed = True
            logger.warning("S3 store: could not spool %s in %s (%s); tables are written and read through memory "
                           "instead", name, self.spool_dir or tempfile.gettempdir(), " ".join(str(exc).split()))

    def _read(self, name: str) -> StoredObject | None:
        with self._errors(f"reading {name}"):
            try:
                response = self._client.get_object(self.bucket, self._object(name))
            except S3Error as exc:
                if exc.code in _MISSING_CODES:
                    return None
                raise
            try:
                data = response.read()
                return self._headers_to_info(response.headers, data)
            finally:
                response.close()
                response.release_conn()

    def _read_mapped(self, name: str) -> StoredObject | None:
        """Downloaded into a spool file, mapped read-only into memory and unlinked: a table's bytes are the OS's
        file cache (the mapping keeps the unlinked file), not a private copy (a D1 task's layer of an 8B model at
        the full corpus is ~1.7 GB, and several tasks read at once). Where the spool cannot take it: _read."""
        with self._spool(name) as folder:
            if folder is not None:
                path = folder / "object"
                try:
                    with self._errors(f"reading {name}"):
                        try:
                            stat = self._client.fget_object(self.bucket, self._object(name), str(path))
                        except S3Error as exc:
                            if exc.code in _MISSING_CODES:
                                return None
                            raise
                    return self._headers_to_info(stat.metadata, map_file(path))
                except OSError as exc:  # no room, no permission (network failures arrive as StoreError)
                    self._unspooled(name, exc)
        return self._read(name)

    def _read_info(self, name: str) -> StoredObject | None:
        with self._errors(f"checking {name}"):
            try:
                stat = self._client.stat_object(self.bucket, self._object(name))
            except S3Error as exc:
                if exc.code in _MISSING_CODES:
                    return None
                raise
            return self._headers_to_info(stat.metadata)

    def _names(self, prefix: str) -> list[str]:
        cut = len(self.prefix)
        with self._errors(f"listing {prefix or '/'}"):
            return [
                o.object_name[cut:]
                for o in self._client.list_objects(self.bucket, prefix=self._object(prefix), recursive=True)
                if o.object_name and not o.is_dir
            ]

    def _remove(self, name: str) -> None:
        with self._errors(f"deleting {name}"):
            self._client.remove_object(self.bucket, self._object(name))

    def _write_file(self, name: str, src: Path, sha256: str) -> None:
        with self._errors(f"uploading {src} as {name}"):
            self._client.fput_object(
                self.bucket, self._object(name), str(src), metadata=self._object_metadata(sha256)
            )

    def _read_file(self, name: str, dest: Path) -> bool:
        with self._errors(f"downloading {name}"):
            try:
                self._client.fget_object(self.bucket, self._object(name), str(dest))
            except S3Error as exc:
                if exc.code in _MISSING_CODES:
                    return False
                raise
        return True
