"""Every private Ray Train attribute orchestrator uses, found and checked in one place.

A Ray Train job's workers run inside the job's own placement group (docs/design/ray-train.md):
that needs Ray Train v2's internals, which move between releases without notice. Each one is
named here, looked up once, and checked for the shape we call it with, so that another Ray
version fails with one error that names the version found and everything missing, never with
an AttributeError deep inside Train's controller. This module does not import Ray at import
time: the client's support check and the rank program read the names below without it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# What the rank program hands the user's script (and so Train's controller) through the
# environment: the callback Train loads, the job's group, how many workers it admitted, and the
# storage root each report is stored under (the job's own).
RAY_TRAIN_CALLBACKS_ENV = "RAY_TRAIN_CALLBACKS"
TRAIN_PG_ENV = "ORCHESTRATOR_TRAIN_PG"
TRAIN_WORKERS_ENV = "ORCHESTRATOR_TRAIN_WORKERS"
TRAIN_REPORTS_ROOT_ENV = "ORCHESTRATOR_TRAIN_REPORTS_ROOT"
# The job's checkpointing_config.checkpoint_path, where Train's checkpoints go, if it is set.
TRAIN_CHECKPOINT_PATH_ENV = "ORCHESTRATOR_TRAIN_CHECKPOINT_PATH"
CALLBACK_PATH = "orchestrator.agents.ray_train_callback.OrchestratorTrainCallback"

_TRAIN = "ray.train.v2._internal"

# (module, attribute, what must hold of it: attribute names, call parameters or a value)
_SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (f"{_TRAIN}.execution.controller.controller", "TrainController", ("worker_group_cls",)),
    (f"{_TRAIN}.execution.worker_group.worker_group", "WorkerGroup",
     ("_create_placement_group", "_create_workers", "get_worker_group_state")),
    (f"{_TRAIN}.execution.worker_group.placement_group_handle", "DefaultPlacementGroupHandle",
     ("shutdown", "placement_group")),
    (f"{_TRAIN}.callbacks.placement_group_callback", "PlacementGroupCleanerCallback",
     ("after_worker_group_start",)),
    (f"{_TRAIN}.execution.callback", "ControllerCallback",
     ("after_controller_start", "before_controller_execute_failure_decision",
      "after_controller_finish", "before_controller_abort")),
    (f"{_TRAIN}.execution.callback", "WorkerGroupCallback", ("after_worker_group_poll_status",)),
    (f"{_TRAIN}.execution.callback", "ReportCallback", ("after_report",)),
    (f"{_TRAIN}.execution.failure_handling", "FailureDecision", ("RETRY",)),
    ("ray.train.v2.api.exceptions", "ControllerError", ()),
    # The trainer whose fit() makes RAY_TRAIN_CALLBACKS's callbacks (`calling_trainer`).
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer",
     ("_create_default_callbacks",)),
    # The run's snapshot, as a retried attempt's is written (`resume_snapshot`).
    (f"{_TRAIN}.execution.checkpoint.checkpoint_manager", "_CheckpointManagerState",
     ("model_fields",)),
    (f"{_TRAIN}.execution.checkpoint.checkpoint_manager", "_TrainingResultState",
     ("model_fields",)),
)  # fmt: skip
# Parameters we pass by name: their absence would be a TypeError inside Train's controller.
_PARAMETERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("WorkerGroup", "_create_placement_group"): ("scaling_config", "worker_group_context"),
    ("WorkerGroup", "_create_workers"): ("placement_group_bundle_indices",),
    # Train's report handler passes both by name.
    ("ReportCallback", "after_report"): ("training_report", "metrics"),
}
# Values we depend on: the variable Train reads its callbacks from.
_VALUES: tuple[tuple[str, str, str], ...] = (
    (f"{_TRAIN}.constants", "RAY_TRAIN_CALLBACKS_ENV_VAR", RAY_TRAIN_CALLBACKS_ENV),
)


class RayTrainSeamsMissing(RuntimeError):
    """This Ray's Train lacks something orchestrator places a Ray Train job's workers with."""

    def __init__(self, version: str, missing: list[str]) -> None:
        super().__init__(
            f"this Ray ({version}) lacks what orchestrator runs a Ray Train job with: "
            f"{'; '.join(missing)}. Ray Train jobs run on Ray 2.60 (the newest of the "
            "supported range): install it, or run the job without ray_train (its "
            "start_commands as plain commands)"
        )
        self.version, self.missing = version, missing


@dataclass(frozen=True)
class RayTrainSeams:
    """The Ray Train internals, found: what ray_train_callback.py subclasses and patches."""

    TrainController: type
    WorkerGroup: type
    DefaultPlacementGroupHandle: type
    PlacementGroupCleanerCallback: type
    ControllerCallback: type
    WorkerGroupCallback: type
    ReportCallback: type
    FailureDecision: Any
    ControllerError: type
    DataParallelTrainer: type
    _CheckpointManagerState: type
    _TrainingResultState: type


def find_seams(
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    version: str | None = None,
) -> RayTrainSeams:
    """Every seam, looked up and checked; RayTrainSeamsMissing naming all that is missing.
    `import_module` and `version` are for a test that fakes a Ray."""
    found: dict[str, Any] = {}
    missing: list[str] = []
    for module, name, members in _SEAMS:
        obj = _lookup(import_module, module, name, missing)
        if obj is None:
            continue
        found[name] = obj
        for member in members:
            if not hasattr(obj, member):
                missing.append(f"{module}.{name}.{member}")
    for (owner, method), parameters in _PARAMETERS.items():
        function = getattr(found.get(owner), method, None)
        if function is None:
            continue  # already reported
        have = _parameters(function)
        missing += [f"the parameter {p!r} of {owner}.{method}" for p in parameters if p not in have]
    for module, name, expected in _VALUES:
        value = _lookup(import_module, module, name, missing)
        if value is not None and value != expected:
            missing.append(f"{module}.{name} == {expected!r} (it is {value!r})")
    if missing:
        raise RayTrainSeamsMissing(version or _ray_version(), list(dict.fromkeys(missing)))
    return RayTrainSeams(**found)


def calling_trainer() -> Any | None:
    """The trainer whose `fit()` is making its callbacks now (Train makes RAY_TRAIN_CALLBACKS's
    in `DataParallelTrainer._create_default_callbacks`), before anything has read its
    RunConfig; None when the callback was made some other way."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_create_default_callbacks":
            trainer = frame.f_locals.get("self")
            if hasattr(trainer, "run_config"):
                return trainer
        frame = frame.f_back
    return None


def resume_snapshot(found: RayTrainSeams, checkpoint: str, metrics: dict[str, Any],
                    report_index: int) -> str:  # fmt: skip
    """Train's run snapshot (`checkpoint_manager_snapshot.json`) for a run that resumes from
    `checkpoint` alone, reported as round `report_index` with `metrics`: what a retried
    attempt's `ray.train.get_checkpoint()` then returns."""
    result = found._TrainingResultState(checkpoint_dir_name=checkpoint, metrics=metrics)
    state = found._CheckpointManagerState(
        checkpoint_results=[result], checkpoint_report_indices=[report_index],
        latest_checkpoint_result=result, pending_training_results=[],
        pending_validation_specs=[], current_report_index=report_index + 1,
        validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[],
    )  # fmt: skip
    return state.model_dump_json()


def seams_missing() -> str | None:
    """Why this Ray cannot run a Ray Train job as orchestrator does, or None when it can."""
    try:
        find_seams()
    except RayTrainSeamsMissing as e:
        return str(e)
    return None


_found: RayTrainSeams | None = None


def seams() -> RayTrainSeams:
    """The seams of the Ray installed here, found once a process."""
    global _found
    if _found is None:
        _found = find_seams()
    return _found


def _lookup(import_module: Callable[[str], ModuleType], module: str, name: str,
            missing: list[str]) -> Any:  # fmt: skip
    try:
        return getattr(import_module(module), name)
    except ImportError:
        missing.append(f"the module {module}")
    except AttributeError:
        missing.append(f"{module}.{name}")
    return None


def _parameters(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _ray_version() -> str:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
