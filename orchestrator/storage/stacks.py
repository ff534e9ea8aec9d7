"""Every rank's Python stacks, kept with the job: `jobs/<id>/stacks/<set>/rank-<rank>.txt`.

A set is `attempt-<n>` when the stuck detector took them (controller/stuck.py), with
`silent.json` saying which rank went silent first and for how long, or `taken-<time>` when
`orchestrator stacks` / `job.stacks()` asked for them while the job ran.
"""

from __future__ import annotations

import time

from pydantic import Field

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored


class SilentRanks(Stored):
    """Why an attempt's stacks were taken: its first silent rank, and every silent one."""

    first: int
    silent: list[int] = Field(default_factory=list)
    quiet_s: float  # how long nothing had moved on `first`
    at: float  # epoch seconds


class StackStore:
    """One job's stack sets."""

    def __init__(self, root: StorageRoot, job_id: str) -> None:
        self.root, self.job_id = root, job_id

    def store(
        self, name: str, stacks: dict[int, str], first: int | None = None,
        silent: list[int] | None = None, quiet_s: float = 0.0,
    ) -> str:  # fmt: skip
        """Store a set (`attempt-<n>` or `taken-<time>`); where it is, as a URL or path."""
        for rank, text in sorted(stacks.items()):
            self.root.write_bytes(layout.stacks_file(self.job_id, name, rank), text.encode())
        if first is not None:
            why = SilentRanks(first=first, silent=silent or [first], quiet_s=round(quiet_s, 1),
                              at=time.time())  # fmt: skip
            self.root.write_json(layout.stacks_silent(self.job_id, name), why.model_dump())
        return self.root.path(layout.stacks_dir(self.job_id, name))

    def sets(self) -> list[str]:
        """The job's stack sets, oldest first."""
        try:
            names = self.root.list_names(layout.stacks_root(self.job_id))
        except FileNotFoundError:
            return []
        return sorted(names, key=_taken_order)

    def read(self, name: str) -> dict[int, str]:
        """A set's stacks, by rank."""
        found = {}
        for entry in self.root.list_names(layout.stacks_dir(self.job_id, name)):
            if entry.startswith("rank-") and entry.endswith(".txt"):
                rank = int(entry[len("rank-") : -len(".txt")])
                found[rank] = self.root.read_bytes(
                    layout.stacks_file(self.job_id, name, rank)
                ).decode(errors="replace")
        return dict(sorted(found.items()))

    def silent(self, name: str) -> SilentRanks | None:
        rel = layout.stacks_silent(self.job_id, name)
        if not self.root.exists(rel):
            return None
        return SilentRanks.model_validate(self.root.read_json(rel))


def taken_name(at: float | None = None) -> str:
    """An on-demand set's name: `taken-<UTC time>`, sorting in time order."""
    return "taken-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at or time.time()))


def _taken_order(name: str) -> tuple[int, str]:
    """Attempt sets by number, on-demand sets by time, attempts first."""
    if name.startswith("attempt-") and name[len("attempt-") :].isdigit():
        return 0, f"{int(name[len('attempt-') :]):08d}"
    return 1, name
