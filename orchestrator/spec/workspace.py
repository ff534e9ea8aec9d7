"""What part of the user's disk becomes the job's working directory."""

from __future__ import annotations

from pydantic import Field, StrictStr

from orchestrator.spec.base import StrictModel


class Workspace(StrictModel):
    """Selects the files archived for a job.

    `workspace_root` is resolved relative to the config's directory, which must lie inside it;
    `external_dirs` are added as top-level directories named by their basename; `exclude_dirs` must
    each be a direct child of the root.
    """

    workspace_root: StrictStr | None = None
    external_dirs: list[StrictStr] = Field(default_factory=list)
    exclude_dirs: list[StrictStr] = Field(default_factory=list)
