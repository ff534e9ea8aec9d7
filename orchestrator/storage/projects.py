"""Projects under the storage root: the stable id a project is given the first time it is pushed.

A name may hold any character a person types (`demo/qwen3-0.6b`); storage paths, node
directories and Ray names use the id. Two first pushes of one name at once (a team's CI and a
person) get one id: the name's record is created only if absent. A project pushed before ids
existed keeps its name as its id (its name was a safe path segment then), so what its jobs
stored stays where it is.
"""

from __future__ import annotations

import secrets
import time

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class ProjectRecord(Stored):
    id: str
    name: str
    created_at: float


def new_project_id() -> str:
    """'p' + 9 base-36 characters: safe in paths and Ray names, like a job id."""
    return "p" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class ProjectStore:
    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    def by_name(self, name: str) -> ProjectRecord | None:
        try:
            project_id = self.root.read_json(layout.project_name(name))["id"]
        except FileNotFoundError:
            return None
        return self.get(project_id)

    def get(self, project_id: str) -> ProjectRecord | None:
        """The project with this id. Anything not shaped like an id (a name with '/', one longer
        than a path segment may be) is no project's, and is never made a path."""
        if not layout.is_segment(project_id):
            return None
        try:
            return ProjectRecord.model_validate(self.root.read_json(layout.project(project_id)))
        except FileNotFoundError:
            return None

    def resolve(self, name_or_id: str) -> ProjectRecord | None:
        """The project with this id, else with this name."""
        return self.get(name_or_id) or self.by_name(name_or_id)

    def ensure(self, name: str, legacy: bool = False) -> ProjectRecord:
        """The project of this name, registered now if it is new. `legacy`: jobs of this name
        were stored before ids existed, so the name itself becomes the id (such a name was a
        safe path segment; one that is not gets a new id, as nothing can be stored under it).

        Atomic per name on every kind of root, across processes and machines: the name's
        record is created only if absent, and whoever created it gave the name its id; every
        other registration reads that id back. The project record follows the name's record,
        written by whoever finds it missing, so a registration cut short between the two is
        completed by the next one."""
        if (found := self.by_name(name)) is not None:
            return found
        candidate = name if legacy and layout.is_segment(name) else new_project_id()
        self.root.create_json(layout.project_name(name), {"id": candidate})
        project_id = self.root.read_json(layout.project_name(name))["id"]
        project = ProjectRecord(id=project_id, name=name, created_at=time.time())
        self.root.create_json(layout.project(project_id), project.model_dump(mode="json"))
        return self.get(project_id) or project

    def all(self) -> list[ProjectRecord]:
        names = [n for n in self.root.list_names(layout.projects()) if n.endswith(".json")]
        found = (self.get(n.removesuffix(".json")) for n in names)
        return sorted((p for p in found if p is not None), key=lambda p: p.created_at)
