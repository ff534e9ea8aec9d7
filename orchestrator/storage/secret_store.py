"""Where secret values live: a private directory on the head node, and the nodes' environment.

Both are `SecretSource`s: something that answers `get(name, team)` and can say where it looked.
A cloud secret manager (AWS Secrets Manager, GCP Secret Manager, Vault) is added the same way:
a class with those two methods, listed in `orchestrator.node.secrets.secret_sources()`.

Layout of a `FileSecretStore` (directories 0700, files 0600, owned by the cluster's user):

    <dir>/default/<name>          cluster-wide: every job may read it
    <dir>/teams/<team>/<name>     only jobs of <team>, which read it in place of the default one

The store never lives under the storage root: job records, logs and checkpoints there are
readable by whoever reads the root, and nothing in it is owner-only.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchestrator import settings
from orchestrator.errors import SecretStoreError
from orchestrator.home import orchestrator_home
from orchestrator.spec.base import check_safe_name
from orchestrator.spec.secrets import check_secret_name

SECRETS_DIR_ENV = settings.SECRETS_DIR.name
SECRET_ENV_PREFIX = "ORCHESTRATOR_SECRET_"
_DEFAULT_SCOPE = "default"
_TEAMS = "teams"


@dataclass(frozen=True)
class SecretInfo:
    """What may be shown about a secret: never its value."""

    name: str
    team: str | None  # None: cluster-wide
    modified_at: float  # seconds since the epoch

    @property
    def scope(self) -> str:
        return scope_label(self.team)


def scope_label(team: str | None) -> str:
    """How a scope is named to a user: "team research" or "cluster-wide"."""
    return f"team {team}" if team else "cluster-wide"


class SecretSource(Protocol):
    """One place secret values come from; `resolve_secret` asks each in turn."""

    def get(self, name: str, team: str | None = None) -> str | None:
        """The value a job of `team` (None: no team) gets for `name`, or None if not here."""
        ...

    def describe(self, name: str, team: str | None = None) -> str:
        """Where `get` looked, phrased to follow "secret 'NAME' is not set ..."."""
        ...


def secret_env_name(name: str) -> str:
    """`hf_access_token` -> `ORCHESTRATOR_SECRET_HF_ACCESS_TOKEN`."""
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def check_name(name: str) -> str:
    """`name` if a valid secret name (the spec's `SecretName` rules); else SecretStoreError."""
    try:
        return check_secret_name(name)
    except ValueError as e:
        raise SecretStoreError(str(e)) from None


def check_team(team: str | None) -> str | None:
    """`team` if it is a valid team name (the spec's `team_name` rules), else SecretStoreError."""
    if team is None:
        return None
    try:
        return check_safe_name(team)
    except ValueError as e:
        raise SecretStoreError(f"team name: {e}") from None


def store_description(name: str, team: str | None) -> str:
    """How a user puts `name` where a job of `team` finds it; shared by the store's proxies."""
    if team:
        return (
            f"for team {team!r} in the secret store (orchestrator secrets set {name} --team {team})"
        )
    return f"in the secret store (orchestrator secrets set {name})"


def default_secrets_dir() -> Path:
    """$ORCHESTRATOR_SECRETS_DIR, else `secrets/` under $ORCHESTRATOR_HOME; never in the root."""
    from orchestrator.storage.root import default_storage_root

    configured = settings.SECRETS_DIR.get()
    directory = Path(configured).expanduser() if configured else orchestrator_home() / "secrets"
    directory = directory.absolute()
    root = default_storage_root()
    if "://" not in root or root.startswith("file://"):
        root_dir = Path(root.removeprefix("file://")).expanduser().absolute()
        if directory == root_dir or root_dir in directory.parents:
            raise SecretStoreError(
                f"the secret store {directory} is inside the storage root {root_dir}, which is not "
                f"private: set {SECRETS_DIR_ENV} to a directory outside it"
            )
    return directory


class FileSecretStore:
    """Secrets as owner-only files; every call reads the disk, so changes apply at once."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory).absolute() if directory else default_secrets_dir()

    def __repr__(self) -> str:
        return f"FileSecretStore({str(self.directory)!r})"

    # -- SecretSource --------------------------------------------------------------------------

    def get(self, name: str, team: str | None = None) -> str | None:
        """The team's value if it has one, else the cluster-wide one; never another team's."""
        check_name(name)
        scopes = [self._scope(check_team(team)), self._scope(None)] if team else [self._scope(None)]
        for scope in scopes:
            path = scope / name
            try:
                self._check_private_chain(path)
                return path.read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
        return None

    def describe(self, name: str, team: str | None = None) -> str:
        return store_description(name, team)

    # -- managing secrets ----------------------------------------------------------------------

    def set(self, name: str, value: str, team: str | None = None) -> None:
        """Write atomically: a reader sees the old value or the new one, never half of one."""
        check_name(name)
        if not value:
            raise SecretStoreError(f"secret {name!r}: the value is empty; nothing was set")
        scope = self._make_scope(check_team(team))
        tmp = scope / f".{name}.{uuid.uuid4().hex[:8]}.tmp"  # names never start with '.'
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)  # the umask may have taken the owner's bits
                f.write(value.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, scope / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete(self, name: str, team: str | None = None) -> bool:
        """Remove the secret of exactly this scope; False if it was not there."""
        check_name(name)
        path = self._scope(check_team(team)) / name
        try:
            self._check_private_chain(path.parent)
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def names(self, team: str | None = None) -> list[SecretInfo]:
        """The secrets of exactly this scope (None: the cluster-wide ones), by name."""
        scope = self._scope(check_team(team))
        try:
            self._check_private_chain(scope)
            entries = sorted(scope.iterdir())
        except FileNotFoundError:
            return []
        found = []
        for path in entries:
            if path.name.startswith(".") or not path.is_file():
                continue  # a temporary file of a `set` in progress
            try:
                found.append(SecretInfo(path.name, team, path.stat().st_mtime))
            except FileNotFoundError:
                continue  # deleted meanwhile
        return found

    def visible(self, team: str | None = None) -> list[SecretInfo]:
        """What a job of `team` reads: its own secrets, then cluster-wide ones not shadowed."""
        own = self.names(team) if team else []
        taken = {s.name for s in own}
        return own + [s for s in self.names(None) if s.name not in taken]

    def teams(self) -> list[str]:
        """Teams that have a scope of their own."""
        teams_dir = self.directory / _TEAMS
        try:
            self._check_private_chain(teams_dir)
            return sorted(p.name for p in teams_dir.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    # -- layout and permissions ----------------------------------------------------------------

    def _scope(self, team: str | None) -> Path:
        return self.directory / _TEAMS / team if team else self.directory / _DEFAULT_SCOPE

    def _make_scope(self, team: str | None) -> Path:
        """The scope's directory, creating it and the ones above it (up to the store) as 0700."""
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        current = self.directory
        self._make_private_dir(current)
        for part in self._scope(team).relative_to(self.directory).parts:
            current = current / part
            self._make_private_dir(current)
        return current

    @staticmethod
    def _make_private_dir(path: Path) -> None:
        try:
            os.mkdir(path, 0o700)  # never more than 0700, whatever the umask
        except FileExistsError:
            _check_private(path)
            return
        os.chmod(path, 0o700)  # and the owner's own bits, whatever the umask

    def _check_private_chain(self, path: Path) -> None:
        """Check the store's directory and each one below it down to `path`, and `path` itself."""
        current = self.directory
        _check_private(current)
        for part in path.relative_to(self.directory).parts:
            current = current / part
            _check_private(current)


def _check_private(path: Path) -> None:
    """Refuse what other users could read or swap out, as ssh refuses an open private key."""
    st = os.stat(path)  # FileNotFoundError goes to the caller: "not set"
    if st.st_uid != os.getuid():
        raise SecretStoreError(
            f"{path} belongs to another user (uid {st.st_uid}): the secret store must be owned "
            f"by the user running the cluster; set {SECRETS_DIR_ENV} to a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        wanted = "700" if stat.S_ISDIR(st.st_mode) else "600"
        raise SecretStoreError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run `chmod {wanted} {path}`, then check who may have read it"
        )


class EnvSecrets:
    """`ORCHESTRATOR_SECRET_<NAME>` in this process's environment: for CI and single-user setups.

    Teams are not distinguished: whoever starts the Ray nodes decides what they hold.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def get(self, name: str, team: str | None = None) -> str | None:
        return self._environ.get(secret_env_name(name))

    def describe(self, name: str, team: str | None = None) -> str:
        return f"as {secret_env_name(name)} on this node"
