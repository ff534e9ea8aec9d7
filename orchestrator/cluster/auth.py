"""The embedded cluster's token: Ray's token authentication on, so that nothing on this machine
(another user, a job's code in its container, a browser page) reaches the cluster's Job API,
dashboard, GCS or Ray Client without it.

The token is a file in $ORCHESTRATOR_HOME, readable by its owner only, made on first use. Ray's
processes and our clients find it through RAY_AUTH_TOKEN_PATH, so its value never appears in an
environment, a command line, a runtime_env or a record. One token per home: every embedded
cluster started from it (and every client of them) shares it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from orchestrator.home import orchestrator_home

TOKEN_FILE = "ray-auth-token"


def token_file(home: Path | None = None) -> Path:
    """The home's token file, made (0600, whole) if it is not there yet."""
    path = (home or orchestrator_home()) / TOKEN_FILE
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # the first of two racing commands wins; the other reads its token
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path


_told: str | None = None  # the token file Ray's loader in this process was last pointed at


def use_token(path: Path) -> None:
    """Make this process a client of a cluster whose token is `path`. Ray reads the mode and
    the token once per process, so another file than the one Ray was last told of (another
    home, or the environment changed under us) is told to Ray's config and token loader."""
    global _told
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    if _told != str(path):
        from orchestrator import ray_private

        ray_private.reset_token_cache()  # Ray read its settings at import, if it was imported
    _told = str(path)


# Ray's words: the Job API's 401 and 403, its client finding no token to send, a gRPC refusal.
_REFUSALS = (
    "Authentication required",
    "Authentication failed",
    "couldn't find an authentication",
    "InvalidAuthToken",
)


def refusal(error: BaseException, address: str | None = None) -> str | None:
    """One line for a cluster's refusal of this client's token (none, or not the cluster's),
    saying where this client looked; None for any other error. Ray's own message is a paragraph
    of advice for its own CLI."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if any(m in text for m in _REFUSALS):
            break
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    else:
        return None
    where = f"the Ray cluster at {address}" if address else "the Ray cluster"
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN"
    else:
        source = os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or _readable(Path(source).expanduser())
    sent = os.environ.get("RAY_AUTH_MODE") == "token" and has_token
    # A gRPC refusal (ray.init) says "missing or incorrect": which one is this client's to say.
    if "Authentication failed" in text or ("InvalidAuthToken" in text and sent):
        return (f"{where} refused this client's token ({source}): it is not the cluster's; "
                "put the cluster's token there")  # fmt: skip
    if os.environ.get("RAY_AUTH_MODE") != "token":
        return (f"{where} demands a token: export RAY_AUTH_MODE=token and put the cluster's "
                "token in ~/.ray/auth_token (or name its file in RAY_AUTH_TOKEN_PATH)")  # fmt: skip
    return (f"{where} demands a token and this client has none ({source} is missing or "
            "empty); put the cluster's token there")  # fmt: skip


def _readable(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False
