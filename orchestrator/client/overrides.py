"""Command-line overrides applied to a loaded project before it is pushed (`--node-count` ...)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from orchestrator.errors import ConfigError
from orchestrator.spec.training import TrainingProject
from orchestrator.spec.validation import describe_validation_error


@dataclass(frozen=True)
class Overrides:
    job_name: str | None = None
    team: str | None = None
    node_count: int | None = None
    accelerator: str | None = None  # "H100:8"
    entrypoint: str | None = None  # replaces start_commands
    interactive: str | None = None  # an interactive_session trigger, e.g. "on_failure"
    interactive_timeout_minutes: int | None = None
    priority: int | None = None
    spot: bool = False  # availability_model spot; the flag always wins
    max_duration: str | float | None = None  # "2h", "90m", or seconds (our extension)

    def apply(self, project: TrainingProject) -> tuple[TrainingProject, list[str]]:
        """The overridden project (validated) and one warning per value it replaced."""
        data = project.model_dump(mode="json")
        job, warnings = data["job"], []

        def put(section: dict, key: str, value: object, label: str) -> None:
            old = section.get(key)
            if old not in (None, [], value):
                warnings.append(f"{label} {value!r} overrides {old!r} from the config")
            section[key] = value

        if self.job_name is not None:
            put(job, "name", self.job_name, "--job-name")
        if self.team is not None:
            put(data, "team_name", self.team, "--team")
        if self.node_count is not None:
            put(job["compute"], "node_count", self.node_count, "--node-count")
        if self.accelerator is not None:
            old = job["compute"].get("accelerator")
            if old and old.get("accelerator"):
                old_text = f"{old['accelerator']}:{old['count']}"
                if old_text != self.accelerator:
                    warnings.append(f"--accelerator {self.accelerator} overrides {old_text}")
            job["compute"]["accelerator"] = self.accelerator
        if self.entrypoint is not None:
            put(job["runtime"], "start_commands", [self.entrypoint], "--entrypoint")
        if self.interactive is not None or self.interactive_timeout_minutes is not None:
            # As `truss train push`: the session is created if the config has none.
            session = job.get("interactive_session") or {}
            if self.interactive is not None:
                put(session, "trigger", self.interactive.lower(), "--interactive")
            if self.interactive_timeout_minutes is not None:
                put(session, "timeout_minutes", self.interactive_timeout_minutes,
                    "--interactive-timeout-minutes")  # fmt: skip
            job["interactive_session"] = session
        if self.priority is not None:
            put(job, "priority", self.priority, "--priority")
        if self.spot:
            if job["compute"].get("availability_model") == "dedicated":
                job["compute"]["availability_model"] = None  # the default: nothing to warn of
            put(job["compute"], "availability_model", "spot", "--spot")
        if self.max_duration is not None:
            put(job, "max_duration", self.max_duration, "--max-duration")
        try:
            return TrainingProject.model_validate(data, strict=False), warnings
        except ValidationError as e:
            raise ConfigError(
                "The overrides make the project invalid:",
                describe_validation_error(e, TrainingProject, ""),
            ) from None
