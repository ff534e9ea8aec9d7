"""Showing a directory somewhere else on a node: the links behind weights and cache mounts.

A link is made under a temporary name and renamed into place, so a reader sees the old target or
the new one, never nothing. A job removes only the links that still point where it put them.
"""

from __future__ import annotations

import contextlib
import getpass
import os
from pathlib import Path

from orchestrator.errors import OrchestratorError


class MountError(OrchestratorError):
    """A mount cannot be made where the config asks on this node."""


def place_link(link: Path, target: str, field: str) -> None:
    """Make `link` point at `target`, replacing an earlier link or an empty directory.

    `field` names what the user set, for errors ("mount_location").
    """
    if link.is_symlink() or not link.exists():
        pass  # nothing there, or an earlier job's link: replaced below
    elif link.is_dir() and not any(link.iterdir()):
        link.rmdir()
    else:
        raise MountError(
            f"{field} {link} already exists on this node and is not empty: choose another "
            "path or remove it"
        )
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except OSError as e:
        why = (
            f"permission denied for user {getpass.getuser()}"
            if isinstance(e, PermissionError)
            else e.strerror or type(e).__name__
        )
        raise MountError(
            f"cannot create {field} {link} on this node: {why}; choose a directory the user "
            "running Ray can create"
        ) from None


def remove_links(links: list[tuple[Path, str]]) -> None:
    """Remove each link that still points at the target this job gave it."""
    for link, target in links:
        with contextlib.suppress(OSError):
            if os.readlink(link) == target:
                link.unlink()
