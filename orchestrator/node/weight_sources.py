"""Reading a weights source: resolve its revision, list its files, fetch one.

`hf://` goes through huggingface_hub (honouring HF_ENDPOINT); every other scheme through an
fsspec filesystem (s3fs, gcsfs, s3fs at R2's or CoreWeave's endpoint, adlfs, fsspec's http).
Credentials come from the source's secret, resolved by the caller where the copy happens; a
filesystem made with them is never shared through fsspec's instance cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from orchestrator import settings
from orchestrator.errors import SourceError
from orchestrator.spec.weights import WeightsSource

# Telemetry and progress bars would reach the internet and the job log.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

R2_ENDPOINT_ENV = settings.R2_ENDPOINT_URL.name
CW_ENDPOINT_ENV = settings.CW_ENDPOINT_URL.name
_HF_REPO = re.compile(
    r"^hf://(?:(?P<kind>datasets|spaces|models)/)?(?P<repo>[^@]+)(?:@(?P<rev>.+))?$"
)


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the source, "/"-separated
    size: int


class Source(Protocol):
    identity: str  # the source without its revision: what the mirror key is made of

    def resolve(self) -> str:
        """The revision the source is at now (one request: the freshness check)."""

    def files(self) -> list[RemoteFile]:
        """Every file at the resolved revision (call `resolve` first)."""

    def fetch(self, path: str, local: Path) -> None:
        """Write one file of the resolved revision to `local`."""


def open_source(spec: WeightsSource, secret: str | None) -> Source:
    if spec.scheme == "hf":
        return HubSource(spec.source, secret)
    return FsspecSource(spec.source, secret)


class HubSource:
    """A Hugging Face repository; branches and tags resolve to the commit they point at."""

    def __init__(self, source: str, token: str | None) -> None:
        from huggingface_hub import HfApi

        match = _HF_REPO.match(source)
        if match is None:  # the spec validated it already
            raise SourceError(f"{source!r} is not hf://owner/repo[@revision]")
        kind = match["kind"] or "models"
        self.repo_id, self.repo_type = match["repo"], kind.removesuffix("s")
        self.requested = match["rev"] or "main"
        prefix = "" if kind == "models" else f"{kind}/"
        self.identity = f"hf://{prefix}{self.repo_id}"
        self.endpoint = os.environ.get("HF_ENDPOINT") or None
        self.token: str | bool = token or False  # never a token the node happens to have
        self.api = HfApi(endpoint=self.endpoint, token=self.token)
        self.revision: str | None = None
        self._files: list[RemoteFile] = []

    def resolve(self) -> str:
        with _hub_errors(self):
            info = self.api.repo_info(
                self.repo_id,
                repo_type=self.repo_type,
                revision=self.requested,
                files_metadata=True,
            )
        self.revision = str(info.sha)
        self._files = [RemoteFile(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
        return self.revision

    def files(self) -> list[RemoteFile]:
        return list(self._files)

    def fetch(self, path: str, local: Path) -> None:
        from huggingface_hub import hf_hub_download

        local.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".hf-", dir=local.parent))
        try:
            with _hub_errors(self):
                got = hf_hub_download(
                    self.repo_id,
                    path,
                    repo_type=self.repo_type,
                    revision=self.revision,
                    local_dir=staging,
                    token=self.token,
                    endpoint=self.endpoint,
                )
            os.replace(got, local)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _hub_errors(source: HubSource) -> Any:
    from huggingface_hub import errors

    where = f"{source.identity}@{source.requested}"
    try:
        yield
    except errors.GatedRepoError:
        raise SourceError(
            f"{where}: gated repository; accept its terms with the token's account"
        ) from None
    except errors.RepositoryNotFoundError:
        raise SourceError(
            f"{where}: repository not found (or not visible with the given token)"
        ) from None
    except errors.RevisionNotFoundError:
        raise SourceError(f"{where}: revision {source.requested!r} not found") from None
    except errors.LocalEntryNotFoundError as e:  # how a download reports an unreachable Hub
        raise SourceError(f"{where}: cannot reach {source.api.endpoint}: {first_line(e)}") from None
    except (errors.EntryNotFoundError, errors.RemoteEntryNotFoundError) as e:
        raise SourceError(f"{where}: file not found: {first_line(e)}") from None
    except errors.HfHubHTTPError as e:
        code = getattr(e.response, "status_code", None)
        if code in (401, 403):
            raise SourceError(
                f"{where}: access denied ({code}): check the source's secret"
            ) from None
        raise SourceError(f"{where}: {first_line(e)}") from None
    except Exception as e:  # connection refused (httpx's own errors), DNS, disk
        raise SourceError(f"{where}: {type(e).__name__}: {first_line(e)}") from None


class FsspecSource:
    """A prefix (or one object) in an object store, or one file over https."""

    def __init__(self, source: str, secret: str | None) -> None:
        self.identity = source
        self.fs, self.root = _filesystem(source, secret)
        self._files: dict[str, str] = {}  # relative path -> full path in the filesystem
        self._sizes: dict[str, int] = {}

    def resolve(self) -> str:
        """A fingerprint of the listing: names, sizes and version tags (ETag, generation, ...)."""
        with _fs_errors(self.identity):
            found: dict[str, dict[str, Any]] = {}
            if not self.identity.startswith("https://"):
                found = self.fs.find(self.root, detail=True, withdirs=False)
            if not found:  # a single object (or an https file)
                info = self.fs.info(self.root)
                if info.get("type") == "directory":
                    raise SourceError(f"{self.identity}: nothing there (an empty directory)")
                found = {self.root: info}
        single = len(found) == 1 and _same(next(iter(found)), self.root)
        entries = []
        for full, info in sorted(found.items()):
            rel = posixpath.basename(full) if single else full[len(self.root) :].lstrip("/")
            if single and self.identity.startswith("https://"):
                rel = posixpath.basename(urlsplit(self.identity).path)
            if not rel or any(part in ("", ".", "..") for part in rel.split("/")):
                raise SourceError(f"{self.identity}: cannot place an object named {full!r}")
            self._files[rel] = full
            self._sizes[rel] = int(info.get("size") or 0)
            entries.append((rel, self._sizes[rel], _version_tag(info)))
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:20]

    def files(self) -> list[RemoteFile]:
        return [RemoteFile(rel, self._sizes[rel]) for rel in self._files]

    def fetch(self, path: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with _fs_errors(self.identity):
            self.fs.get_file(self._files[path], str(local))


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _version_tag(info: dict[str, Any]) -> str:
    for field in ("ETag", "etag", "generation", "md5Hash", "Last-Modified", "LastModified"):
        if info.get(field):
            return str(info[field])
    return str(info.get("mtime") or info.get("updated") or "")


@contextlib.contextmanager
def _fs_errors(where: str) -> Any:
    try:
        yield
    except SourceError:
        raise
    except FileNotFoundError as e:
        raise SourceError(f"{where}: not found ({first_line(e)})") from None
    except PermissionError:
        raise SourceError(f"{where}: access denied: check the source's secret") from None
    except Exception as e:  # the clients' own errors (botocore, aiohttp, google) vary widely
        text = first_line(e)
        if any(s in text for s in ("AccessDenied", "Forbidden", "403", "401", "InvalidAccessKey")):
            raise SourceError(
                f"{where}: access denied: check the source's secret ({text})"
            ) from None
        if any(s in text for s in ("NoSuchBucket", "NoSuchKey", "404", "Not Found")):
            raise SourceError(f"{where}: not found ({text})") from None
        raise SourceError(f"{where}: {type(e).__name__}: {text}") from None


def _filesystem(source: str, secret: str | None) -> tuple[Any, str]:
    import fsspec

    scheme, _, rest = source.partition("://")
    common: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if scheme == "https":
        return fsspec.filesystem("https", skip_instance_cache=True), source
    if scheme in ("s3", "r2", "cw"):
        creds = _json_secret(source, secret, ("aws_access_key_id", "aws_secret_access_key"))
        options: dict[str, Any] = {**common}
        if creds:
            options["key"] = creds["aws_access_key_id"]
            options["secret"] = creds["aws_secret_access_key"]
            if creds.get("aws_region"):
                options["client_kwargs"] = {"region_name": creds["aws_region"]}
        if scheme == "r2":
            account, _, bucket_path = rest.partition(".")
            template = settings.R2_ENDPOINT_URL.get()
            options["endpoint_url"] = template.format(account_id=account)
            rest = bucket_path
        if scheme == "cw":
            options["endpoint_url"] = settings.CW_ENDPOINT_URL.get()
            # CoreWeave serves only virtual-hosted requests (https://bucket.cwobject.com/key), at
            # cwlota.com too. botocore still addresses an endpoint given as an IP by path, as a
            # loopback test server needs.
            options["config_kwargs"] = {"s3": {"addressing_style": "virtual"}}
        return fsspec.filesystem("s3", **options), rest.rstrip("/")
    if scheme == "gs":
        token: Any = None
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            token = "anon"  # an emulator takes no credentials
        elif secret:
            token = _json_secret(source, secret, ("client_email", "private_key"))
        return fsspec.filesystem("gs", token=token, **common), rest.rstrip("/")
    if scheme == "azure":
        try:
            import adlfs
        except ImportError:
            raise SourceError(
                f"{source}: azure:// sources need the adlfs package where the mirror runs: "
                "pip install adlfs on the cluster's nodes"
            ) from None
        account, _, container_path = rest.partition("/")
        creds = _json_secret(source, secret, ()) or {}
        fs = adlfs.AzureBlobFileSystem(account_name=account, **creds, **common)
        return fs, container_path.rstrip("/")
    raise SourceError(f"{source}: scheme {scheme}:// is not supported")


def _json_secret(source: str, secret: str | None, required: tuple[str, ...]) -> dict[str, Any]:
    """A secret holding JSON credentials; its value never goes into an error message."""
    if not secret:
        return {}
    try:
        creds = json.loads(secret)
    except ValueError:
        raise SourceError(f"{source}: the source's secret is not JSON") from None
    if not isinstance(creds, dict):
        raise SourceError(f"{source}: the source's secret is not a JSON object")
    missing = [k for k in required if not creds.get(k)]
    if missing:
        raise SourceError(f"{source}: the source's secret lacks {', '.join(missing)}")
    return creds


def first_line(e: BaseException) -> str:
    """An error's first line, short enough for a status or a log line."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
