"""What of Baseten's vocabulary orchestrator cannot honour, said before anything is submitted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator import settings
from orchestrator.errors import UnsupportedFeatureError
from orchestrator.spec.training import AvailabilityModel, TrainingJob
from orchestrator.spec.weights import WeightsAuthMethod


@dataclass(frozen=True)
class SupportReport:
    errors: tuple[str, ...]  # push refuses the job
    notices: tuple[str, ...]  # accepted, but behaves differently from Baseten

    def raise_for_errors(self) -> None:
        if self.errors:
            raise UnsupportedFeatureError(
                "This job asks for something orchestrator cannot do:\n"
                + "\n".join(f"  - {e}" for e in self.errors)
            )


# Counts beyond any cluster these jobs run on: a typo (node_count=80 for 8) is refused before
# anything is submitted, rather than waiting the scheduling timeout out.
MAX_NODE_COUNT = settings.MAX_NODE_COUNT
MAX_CPU_COUNT = settings.MAX_CPU_COUNT
MAX_GPUS_PER_NODE = settings.MAX_GPUS_PER_NODE
MAX_MEMORY_BYTES = settings.MAX_MEMORY_BYTES


def limit(setting: settings.Setting[int]) -> int:
    """A limit's value: its variable, else the default; a bad value is a SettingError."""
    return setting.get()


def _over_limits(job: TrainingJob) -> list[str]:
    compute = job.compute
    checks = (
        ("compute.node_count", compute.node_count, MAX_NODE_COUNT, "nodes"),
        ("compute.cpu_count", compute.cpu_count, MAX_CPU_COUNT, "CPUs per node"),
        ("compute.accelerator.count", compute.gpus_per_node, MAX_GPUS_PER_NODE, "GPUs per node"),
        ("compute.memory", compute.memory_bytes, MAX_MEMORY_BYTES, "bytes of memory per node"),
    )
    return [
        f"{field}: {value} {what} is more than any cluster here has (at most "
        f"{limit(setting)}; {setting.name} raises the limit)"
        for field, value, setting, what in checks
        if value > limit(setting)
    ]


def _session_editor(job: TrainingJob) -> list[str]:
    session = job.interactive_session
    if session is None:
        return []
    return [
        f"interactive_session ({session.trigger.value}): the nodes are held for "
        f"{session.timeout_minutes} min as the trigger says; reach them with `orchestrator "
        f"shell --job-id ID` (no {session.session_provider.value} remote editor here)"
    ]


def _cloud_weights_auth(job: TrainingJob) -> list[str]:
    return [
        f"weights[{i}].auth: {w.auth.auth_method.value} is Baseten's cloud identity; "
        "use auth_method CUSTOM_SECRET with a secret holding the credentials"
        for i, w in enumerate(job.weights)
        if w.auth and w.auth.auth_method != WeightsAuthMethod.CUSTOM_SECRET
    ]


def _loops_checkpoints(job: TrainingJob) -> list[str]:
    load = job.runtime.load_checkpoint_config
    if load is None or not load.enabled:
        return []
    return [
        f"runtime.load_checkpoint_config.checkpoints[{i}]: Loops checkpoints live in "
        "Baseten Loops; use BasetenCheckpoint references to orchestrator jobs"
        for i, ref in enumerate(load.checkpoints)
        if ref.typ == "loops_checkpoint"
    ]


def _spot(job: TrainingJob) -> list[str]:
    if job.compute.availability_model != AvailabilityModel.SPOT:
        return []
    return ["availability_model spot is recorded only: Ray places the job like any other"]


def _train_seams(job: TrainingJob) -> list[str]:
    """A Ray whose Train lacks what orchestrator places the workers with (ray_train_seams.py)."""
    if job.ray_train is None:
        return []
    from orchestrator.agents.ray_train_seams import seams_missing  # imports Ray Train: only here

    missing = seams_missing()
    return [f"ray_train: {missing}"] if missing else []


@dataclass(frozen=True)
class Unbuilt:
    """A feature with no runtime here (Baseten's, or a part of ours not built yet): `config`,
    the field docs/architecture.md's "Not built yet" names it by; whether push `refused` a job
    that asks for it (else the job runs without it, with a notice); `find`, one message per use
    of it in a job."""

    config: str
    refused: bool
    find: Callable[[TrainingJob], list[str]]


# What check_support says of each, in this order. A new one is one entry here, a row in the docs'
# "Not built yet" and a job that asks for it in tests/test_docs_not_built.py.
UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt("interactive_session.session_provider", refused=False, find=_session_editor),
    Unbuilt("weights[].auth.auth_method", refused=True, find=_cloud_weights_auth),
    Unbuilt(
        "runtime.load_checkpoint_config.checkpoints[].typ", refused=True, find=_loops_checkpoints
    ),
    Unbuilt("compute.availability_model", refused=False, find=_spot),
)


def _ignored_keys(job: TrainingJob) -> list[str]:
    """Keys Baseten's models take and drop (ConfigModel allows extras): dropped here too."""
    models = [("compute.accelerator", job.compute.accelerator)]
    models += [(f"weights[{i}]", w) for i, w in enumerate(job.weights)]
    return [
        f"{where}: {', '.join(map(repr, sorted(model.model_extra)))} is not a field of "
        f"{type(model).__name__} and is ignored (Baseten accepts unknown keys there too)"
        for where, model in models
        if model is not None and model.model_extra
    ]


def check_support(job: TrainingJob) -> SupportReport:
    """What push refuses (the limits, each refused UNBUILT feature, a ray_train job on a Ray
    without Train's seams) and what it notes (each recorded one, then the keys it ignores),
    before anything is created."""
    found = [(gap, message) for gap in UNBUILT for message in gap.find(job)]
    errors = _over_limits(job) + [message for gap, message in found if gap.refused]
    errors += _train_seams(job)
    notices = [message for gap, message in found if not gap.refused] + _ignored_keys(job)
    return SupportReport(errors=tuple(errors), notices=tuple(notices))
