"""Where a job finds its training cache: $BT_RW_CACHE_DIR and the links inside it.

Baseten mounts the caches at `<mount_base_path>/user_artifacts` and `.../team_artifacts`
(default `/root/.cache`). Here they are links to the node's copies. The default base becomes a
directory private to the job (a user who is not root can write it, and two jobs on one node do
not fight over `/root/.cache`); the variables say where it is. A base the config sets is used as
it is, or the deploy fails saying why.
"""

from __future__ import annotations

import contextlib
import getpass
import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import OrchestratorError

PROJECT_LINK, TEAM_LINK, HF_LINK = "user_artifacts", "team_artifacts", "huggingface"


class CacheMountError(OrchestratorError):
    """The cache cannot be shown where the config asks on this node."""


@dataclass
class CacheMounts:
    env: dict[str, str]
    links: list[tuple[Path, str]] = field(default_factory=list)  # link -> its target

    def remove(self) -> None:
        """Remove the links this job made (a later job's links stay)."""
        for link, target in self.links:
            with contextlib.suppress(OSError):
                if os.readlink(link) == target:
                    link.unlink()


def mount_caches(
    base: Path, project_dir: str, team_dir: str, legacy_hf: bool, explicit: bool
) -> CacheMounts:
    """Link the project and team copies under `base`; the job's cache variables."""
    links = {PROJECT_LINK: project_dir, TEAM_LINK: team_dir}
    if legacy_hf:
        hf_dir = Path(project_dir) / HF_LINK
        hf_dir.mkdir(exist_ok=True)
        links[HF_LINK] = str(hf_dir)
    made: list[tuple[Path, str]] = []
    try:
        base.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            link = base / name
            if link.exists() and not link.is_symlink():
                raise CacheMountError(
                    f"{link} already exists on this node and is not a link orchestrator made: "
                    "move it away or set cache_config.mount_base_path elsewhere"
                )
            tmp = base / f".{name}.{os.getpid()}.link"
            os.symlink(target, tmp)
            os.replace(tmp, link)
            made.append((link, target))
    except OSError as e:
        what = "cache_config.mount_base_path" if explicit else "the cache directory"
        why = (
            f"permission denied for user {getpass.getuser()}"
            if isinstance(e, PermissionError)
            else e.strerror or type(e).__name__
        )
        raise CacheMountError(
            f"cannot create {what} {base} on this node: {why}; choose a directory the user "
            "running Ray can create"
        ) from None
    env = {
        "BT_RW_CACHE_DIR": str(base),
        "BT_PROJECT_CACHE_DIR": str(base / PROJECT_LINK),
        "BT_TEAM_CACHE_DIR": str(base / TEAM_LINK),
    }
    if legacy_hf:
        env["HF_HOME"] = str(base / HF_LINK)
    return CacheMounts(env=env, links=made)
