"""Errors a user can hit. Each message says what went wrong and what to do next."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(OrchestratorError):
    """A config is invalid: nothing was submitted.

    `problems` holds one line per problem, each starting with the field path.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [])
        lines = [message, *(f"  - {p}" for p in self.problems)]
        super().__init__("\n".join(lines))


class SettingError(ConfigError):
    """An ORCHESTRATOR_* variable has a value that cannot mean anything (settings.py)."""


class PushWhileLoading(ConfigError):
    """A config called `truss_train.push` while it was being loaded: loading never submits."""


class WorkspaceError(ConfigError):
    """The job's code directory cannot be packaged (missing directory, too large, ...)."""


class UnsupportedFeatureError(OrchestratorError):
    """A config asks for a Baseten feature this orchestrator does not provide."""


class SubmitError(OrchestratorError):
    """Ray's Job API refused a job, or did not take it within ORCHESTRATOR_SUBMIT_WAIT_S."""
