"""Everything `push` does before it talks to a cluster: load, override, check, plan the archive."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.client.config_loader import load_config, validate_project
from orchestrator.client.overrides import Overrides
from orchestrator.client.support import check_support
from orchestrator.client.workspace import WorkspacePlan, plan_workspace
from orchestrator.spec.training import TrainingProject


@dataclass(frozen=True)
class PreparedJob:
    project: TrainingProject
    source_dir: Path
    plan: WorkspacePlan
    warnings: tuple[str, ...]


def prepare_job(
    config: str | Path | TrainingProject | object,
    source_dir: str | Path | None = None,
    overrides: Overrides | None = None,
) -> PreparedJob:
    """Resolve a config path or a project object into a job ready to submit.

    Raises ConfigError, WorkspaceError or UnsupportedFeatureError; nothing is created anywhere.
    A project object's code directory is `source_dir`, else the current directory (as Baseten).
    """
    if isinstance(config, (str, Path)):
        loaded = load_config(config)
        project, default_dir = loaded.project, loaded.source_dir
    else:
        project, default_dir = validate_project(config), Path.cwd()
    project, warnings = (overrides or Overrides()).apply(project)
    support = check_support(project.job)
    support.raise_for_errors()
    plan = plan_workspace(Path(source_dir or default_dir), project.job.workspace)
    return PreparedJob(
        project, Path(source_dir or default_dir), plan, (*warnings, *support.notices)
    )
