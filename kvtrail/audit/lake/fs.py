"""Where a lake lives: a local directory or ``s3://BUCKET/PREFIX``, behind one small file interface.

:class:`LakeFS` names every file by its path relative to the lake's root ('/'-separated), so manifests,
checkpoints and tasks say the same thing on a laptop and on object storage. S3 goes through
``pyarrow.fs.S3FileSystem``; credentials come from the usual AWS environment variables (or the AWS
config files), and ``AWS_ENDPOINT_URL`` points it at another server (a local S3, MinIO).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs

from kvtrail.errors import KvtrailError


def _s3(netloc: str) -> pafs.S3FileSystem:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kw: dict = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if endpoint:
        parsed = urlparse(endpoint)
        kw.update(endpoint_override=parsed.netloc or parsed.path, scheme=parsed.scheme or "https")
    return pafs.S3FileSystem(**kw)


@dataclass(frozen=True)
class LakeFS:
    """A lake's root on a pyarrow filesystem; ``url`` is what the user gave (a directory or s3:// URL)."""

    url: str
    fs: pafs.FileSystem
    root: str  # the root as the filesystem names it (no trailing '/')

    @classmethod
    def open(cls, url: str) -> LakeFS:
        """The lake at ``url``: ``s3://bucket/prefix`` or a local directory (made when missing)."""
        if url.startswith("s3://"):
            parsed = urlparse(url)
            if not parsed.netloc:
                raise KvtrailError(f"lake: {url!r} names no bucket (s3://BUCKET/PREFIX)")
            root = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
            return cls(url, _s3(parsed.netloc), root)
        if "://" in url:
            raise KvtrailError(f"lake: {url!r} is neither a directory nor an s3:// URL")
        root = os.path.abspath(url)
        if os.path.exists(root) and not os.path.isdir(root):
            raise KvtrailError(f"lake: {url} exists and is not a directory")
        return cls(url, pafs.LocalFileSystem(), root)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def write(self, rel: str, data: bytes) -> None:
        """Write a whole file; locally through a temporary name and a rename, so a reader never sees half."""
        try:
            self._write(rel, data)
        except OSError as exc:  # no such bucket, no permission, disk full: one line naming the file
            raise KvtrailError(f"lake {self.url}: cannot write {rel}: {exc}") from None

    def _write(self, rel: str, data: bytes) -> None:
        path = self.full(rel)
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        if not self.is_local:  # an S3 object appears whole when its upload completes
            with self.fs.open_output_stream(path) as out:
                out.write(data)
            return
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def read(self, rel: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.full(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise KvtrailError(f"lake {self.url}: file missing: {rel}") from None
        except OSError as exc:
            raise KvtrailError(f"lake {self.url}: cannot read {rel}: {exc}") from None

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.full(rel)).type == pafs.FileType.File

    def delete(self, rel: str) -> None:
        self.fs.delete_file(self.full(rel))

    def list(self, under: str = "") -> list[str]:
        """Every file below ``under`` (relative paths, sorted); an absent folder has none."""
        base = self.full(under) if under else self.root
        try:
            if self.fs.get_file_info(base).type == pafs.FileType.NotFound:
                return []
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True))
        except OSError as exc:
            raise KvtrailError(f"lake {self.url}: cannot list {under or 'the lake'}: {exc}") from None
        n = len(self.root) + 1
        return sorted(i.path[n:] for i in infos if i.type == pafs.FileType.File)
