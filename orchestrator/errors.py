"""Errors a user can hit. Each message says what went wrong and what to do next.

Every `OrchestratorError` is defined here, whichever layer raises it, so a user (of `push`, a
job handle or the CLI) finds all they may catch in one place; the modules that raise one import
it from here (and keep the old names importable). Exceptions that only carry control flow inside
a process (a stop requested, a node lost mid-call) stay in their modules and never reach a user
as themselves: docs/architecture.md#errors lists both.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose."""


# --- a config or a setting: nothing was submitted -------------------------------------------


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


# --- the cluster -----------------------------------------------------------------------------


class SubmitError(OrchestratorError):
    """Ray's Job API refused a job, or did not take it within ORCHESTRATOR_SUBMIT_WAIT_S."""


class LocalClusterError(OrchestratorError):
    """The embedded local Ray cluster could not be started or stopped."""


class RayVersionError(OrchestratorError):
    """This Ray is outside the range orchestrator supports, or differs from the cluster's: the
    message names the versions found and what to install."""


class RayPrivateApiMissing(RayVersionError, RuntimeError):
    """This Ray lacks a private call orchestrator makes (ray_private.py) and there is no public
    way to do without it."""


# --- the storage root ------------------------------------------------------------------------


class StorageUnavailable(OrchestratorError):
    """The storage root stayed unreachable past the outage budget (or a caller's deadline)."""


class JobNotFound(OrchestratorError):
    """No job has this id in the storage root."""


class ProjectNotFound(OrchestratorError):
    """No project has this name or id."""


class CheckpointNotFound(OrchestratorError):
    """A checkpoint the config asks to load matches nothing stored; the job fails with it."""


class RestoreFailed(OrchestratorError):
    """A rank could not be put at the resume point (a download that failed its checksum, a
    storage root gone): the retry cannot resume from where the job was."""


# --- secrets, weights and mounts on a node ---------------------------------------------------


class SecretStoreError(OrchestratorError):
    """The secret store cannot be used as asked (a bad name, unsafe permissions, ...)."""


class SecretNotFound(OrchestratorError):
    """No source has the secret; the message names it and every place that was asked."""


class SourceError(OrchestratorError):
    """A source that cannot be read as asked: missing, forbidden, or empty after the patterns."""


class MountError(OrchestratorError):
    """A mount cannot be made where the config asks on this node."""


class StagingError(OrchestratorError):
    """A checkpoint or base model could not be made local on the serving node."""


class DeployError(OrchestratorError):
    """A deployment could not be made, or did not become ready."""


def last_line(e: BaseException) -> str:
    """The last line of an error's text, "" if it has none: through Ray an error's text is the
    remote traceback, with the error itself on its last line."""
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else ""
