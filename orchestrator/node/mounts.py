"""Showing a directory somewhere else on a node: the links behind weights and cache mounts.

A link is made under a temporary name and renamed into place, so a reader sees the old target or
the new one, never nothing. Jobs on one node may ask for the same path: a register under the node
root (one JSON file per path, changed under a lock) says which live jobs use a link, so a second
job with the same contents shares it, one with other contents is refused, and the link goes only
when its last user ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orchestrator.errors import MountError
from orchestrator.node.node_root import node_root

Alive = Callable[[str], bool]
Holder = tuple[str, str]  # (the agent's actor name, its job id)


def place_link(link: Path, target: str, field: str, holder: Holder, alive: Alive) -> None:
    """Make `link` point at `target` for `holder`, replacing an earlier job's link or an empty
    directory; `field` names what the user set, for errors ("mount_location").

    Ranks of one job may repoint each other's link (simulated nodes share a filesystem).
    """
    with _entry(link) as entry:
        live = [h for h in _holders(entry) if h != holder and alive(h[0])]
        others = [h for h in live if h[1] != holder[1]]
        if others and entry["target"] != target:
            raise MountError(
                f"{field} {link} is in use on this node by another running job "
                f"({others[0][1]}) with other contents: choose another path"
            )
        if not (live and link.is_symlink() and os.readlink(link) == target):
            _make_link(link, target, field)
        entry.update(target=target, holders=[*live, holder])


def remove_links(links: list[tuple[Path, str]], holder: Holder, alive: Alive) -> None:
    """Give up `holder`'s use of each link; remove those no live job uses any more."""
    for link, target in links:
        with contextlib.suppress(OSError), _entry(link) as entry:
            others = [h for h in _holders(entry) if h != holder and alive(h[0])]
            entry["holders"] = others
            if not others and os.readlink(link) == target:
                link.unlink()


def _make_link(link: Path, target: str, field: str) -> None:
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


def _holders(entry: dict[str, Any]) -> list[Holder]:
    return [(h[0], h[1]) for h in entry.get("holders", [])]


@contextlib.contextmanager
def _entry(link: Path) -> Iterator[dict[str, Any]]:
    """The register's entry for `link`, read and written back under the register's lock."""
    register = node_root() / "mounts"
    register.mkdir(parents=True, exist_ok=True)
    path = register / f"{hashlib.sha256(str(link).encode()).hexdigest()[:32]}.json"
    with open(register / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            entry = {"path": str(link)}
        yield entry
        if entry.get("holders"):
            path.write_text(json.dumps(entry))
        else:
            path.unlink(missing_ok=True)
