"""Where a job finds its training cache: $BT_RW_CACHE_DIR and the links inside it.

Baseten mounts the caches at `<mount_base_path>/user_artifacts` and `.../team_artifacts`
(default `/root/.cache`). Here they are links to the node's copies. The default base becomes a
directory private to the job (a user who is not root can write it, and two jobs on one node do
not fight over `/root/.cache`); the variables say where it is. A base the config sets is used as
it is, or the deploy fails saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import MountError
from orchestrator.node.mounts import Alive, Holder, place_link, remove_links

PROJECT_LINK, TEAM_LINK, HF_LINK = "user_artifacts", "team_artifacts", "huggingface"


@dataclass
class TrainingCacheMounts:
    env: dict[str, str]
    holder: Holder
    alive: Alive
    links: list[tuple[Path, str]] = field(default_factory=list)  # link -> its target

    def remove(self) -> None:
        remove_links(self.links, self.holder, self.alive)


def mount_caches(
    base: Path,
    project_dir: str,
    team_dir: str,
    legacy_hf: bool,
    explicit: bool,
    holder: Holder,
    alive: Alive,
) -> TrainingCacheMounts:
    """Link the project and team copies under `base` for `holder`; the job's cache variables.

    Two jobs on one node that set the same base share it only if they share the caches.
    """
    targets = {PROJECT_LINK: project_dir, TEAM_LINK: team_dir}
    if legacy_hf:
        hf_dir = Path(project_dir) / HF_LINK
        hf_dir.mkdir(exist_ok=True)
        targets[HF_LINK] = str(hf_dir)
    field_name = "cache_config.mount_base_path" if explicit else "the cache directory"
    mounts = TrainingCacheMounts(
        holder=holder,
        alive=alive,
        env={
            "BT_RW_CACHE_DIR": str(base),
            "BT_PROJECT_CACHE_DIR": str(base / PROJECT_LINK),
            "BT_TEAM_CACHE_DIR": str(base / TEAM_LINK),
        },
    )
    if legacy_hf:
        mounts.env["HF_HOME"] = str(base / HF_LINK)
    for name, target in targets.items():
        try:
            place_link(base / name, target, field_name, holder, alive)
        except MountError:
            mounts.remove()  # the links made so far
            raise
        mounts.links.append((base / name, target))
    return mounts
