"""What a rank runs (`RankProgram`): chosen for the job by the controller, run by the rank's node
agent, like Ray Train's per-worker train function but for any kind of work.

A program is plain data that crosses the Ray call in the rank's `StartRequest` and runs on the
node against a `RankContext` (the rank's environment, directory, masking and the runner of its
processes). Today's kind is the job's `start_commands` (`CommandsProgram`). A new kind is one
class with `for_job`, `describe` and `run`, plus one `register` line: nothing else branches on
what a rank runs. `StartRequest` carries the program to the rank, with what it runs with. A
kind whose own workers use the bundle (Ray Train's) says so with `lends_bundle`: its ranks'
agents then hold none of it (controller/plan.py, `RankPlan.agent_share`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from orchestrator import actor_names
from orchestrator.agents.messages import CommandsEnded, MetricsRequest, OutputLines
from orchestrator.agents.ray_train_seams import (
    CALLBACK_PATH,
    RAY_TRAIN_CALLBACKS_ENV,
    TRAIN_CHECKPOINT_PATH_ENV,
    TRAIN_PG_ENV,
    TRAIN_REPORTS_ROOT_ENV,
    TRAIN_WORKERS_ENV,
)
from orchestrator.agents.runtimes import HostRuntime, JobRuntime

if TYPE_CHECKING:
    from orchestrator.agents.command_runner import CommandRunner
    from orchestrator.node.rank_runtime import RankRuntime
    from orchestrator.node.secrets import SecretMasker
    from orchestrator.spec.training import TrainingJob

# The cluster's GCS address, in every rank's environment. Not RAY_ADDRESS itself: a job may start
# a Ray head of its own, which that name would confuse (a Ray Train job gets RAY_ADDRESS too).
CLUSTER_ADDRESS_ENV = "ORCHESTRATOR_RAY_ADDRESS"


@dataclass(frozen=True)
class RankContext:
    """What the node agent gives a rank's program once the rank has joined its group."""

    rank: int
    env: dict[str, str]  # everything the rank's processes see, secrets resolved
    cwd: str
    mask: SecretMasker  # every line a program yields goes through it
    runner: CommandRunner  # runs the rank's processes where the job runs them, and stops them
    runtime: RankRuntime  # where the processes run: the host, or the rank's container
    before_end: Callable[[], None]  # what the program's last item must not race (a last sample)
    tag: Callable[[str, bool], str]  # a line as the job's log shows it: rank, time
    storage_url: str = ""  # the job's storage root (a Ray Train job stores its reports there)

    @property
    def stopping(self) -> threading.Event:
        """Set once the rank is asked to stop: a program that waits wakes up on it."""
        return self.runner.stopping


class RankProgram(Protocol):
    """One kind of work a rank does. Its `run` yields OutputLines as they come and ends with
    one CommandsEnded (its exit code, what failed, the last lines). `lends_bundle`: its
    ranks' agents take none of their bundle, which the program's own workers use (absent:
    False)."""

    lends_bundle: ClassVar[bool]

    @classmethod
    def for_job(cls, job: TrainingJob) -> RankProgram | None:
        """The program of this kind for `job`, or None when the job is not of this kind."""

    def describe(self) -> str:
        """What each rank runs, for the job's log: "2 command(s)"."""

    def run(self, context: RankContext) -> Iterator[OutputLines | CommandsEnded]: ...


@dataclass(frozen=True)
class StartRequest:
    """One rank's program and what it runs with (a new attempt's: its rendezvous is new)."""

    program: RankProgram
    env: dict[str, str]
    secrets: dict[str, str]  # env var -> secret name, resolved on the node
    cwd: str
    gpus_per_node: int
    rendezvous: Any = None  # the job's Rendezvous actor; None for a group of one
    metrics: MetricsRequest | None = None
    runtime: JobRuntime = field(default_factory=HostRuntime)  # where it runs (runtimes.py)


_KINDS: list[type[RankProgram]] = []  # the newest first: the most specific kind wins


def register(kind: type[RankProgram]) -> type[RankProgram]:
    """Make `kind` one the controller chooses from (a class decorator); the last registered is
    asked first, so the commands program, registered here first, is the fallback."""
    if kind not in _KINDS:
        _KINDS.insert(0, kind)
    return kind


def unregister(kind: type[RankProgram]) -> None:
    """Take a kind out again (a test's own kind, once the test is over)."""
    if kind in _KINDS:
        _KINDS.remove(kind)


def program_for(job: TrainingJob) -> RankProgram:
    """The program every rank of `job` runs: the first registered kind that takes the job."""
    for kind in _KINDS:
        program = kind.for_job(job)
        if program is not None:
            return program
    raise LookupError(f"no rank program takes job {job.name!r}")  # the commands program does


@register
@dataclass(frozen=True)
class CommandsProgram:
    """The job's start_commands, one after another through a shell, stopping at the first that
    fails (agents/command_runner.py); every job that is of no other kind runs these."""

    commands: tuple[str, ...]
    lends_bundle: ClassVar[bool] = False

    @classmethod
    def for_job(cls, job: TrainingJob) -> CommandsProgram:
        return cls(tuple(job.runtime.start_commands))

    def describe(self) -> str:
        return f"{len(self.commands)} command(s)"

    def run(self, context: RankContext) -> Iterator[OutputLines | CommandsEnded]:
        yield from context.runner.run(
            self.commands, context.env, context.cwd, context.mask,
            before_end=context.before_end, runtime=context.runtime,
        )  # fmt: skip


@register
@dataclass(frozen=True)
class RayTrainProgram:
    """A `ray_train` job: rank 0 runs the start_commands as the Ray Train driver, joined to this
    cluster, and Train's workers run in the job's placement group, `workers_per_node` in each
    node's bundle (agents/ray_train_callback.py puts them there). The other ranks run nothing:
    their bundles stay reserved for those workers until the job ends."""

    commands: tuple[str, ...]
    workers: int  # node_count x workers_per_node: what the script's ScalingConfig must ask
    checkpoint_path: str | None = None  # checkpointing_config's, where Train's writes go
    lends_bundle: ClassVar[bool] = True  # Train's workers take the bundle, not the agents

    @classmethod
    def for_job(cls, job: TrainingJob) -> RayTrainProgram | None:
        if job.ray_train is None:
            return None
        checkpointing = job.runtime.checkpointing_config
        path = checkpointing.checkpoint_path if checkpointing.enabled else None
        return cls(tuple(job.runtime.start_commands), job.ray_train.workers(job.compute), path)

    def describe(self) -> str:
        return f"Ray Train ({self.workers} workers) from rank 0's {len(self.commands)} command(s)"

    def driver_environment(self, env: dict[str, str], storage_url: str = "") -> dict[str, str]:
        """What rank 0's commands get besides the job's variables: the cluster to join, the
        callback Train loads, the group it borrows, the workers the job was admitted with, and
        the storage root the callback stores each report under."""
        driver = {"RAY_ADDRESS": env[CLUSTER_ADDRESS_ENV]} if CLUSTER_ADDRESS_ENV in env else {}
        if storage_url:
            driver[TRAIN_REPORTS_ROOT_ENV] = storage_url
        if self.checkpoint_path:
            driver[TRAIN_CHECKPOINT_PATH_ENV] = self.checkpoint_path
        return {
            **driver,
            RAY_TRAIN_CALLBACKS_ENV: CALLBACK_PATH,
            TRAIN_PG_ENV: actor_names.placement_group(env["BT_TRAINING_JOB_ID"]),
            TRAIN_WORKERS_ENV: str(self.workers),
            "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",  # the dashboard's Train view
        }

    def run(self, context: RankContext) -> Iterator[OutputLines | CommandsEnded]:
        if context.rank != 0:
            yield OutputLines([context.tag(
                "Ray Train runs from rank 0: this rank runs nothing, its node's share stays "
                "reserved in the job's placement group for Train's workers", False,
            )])  # fmt: skip
            yield CommandsEnded(exit_code=0)
            return
        # Every worker's lines in the job's log, not Ray's "[repeated 3x across cluster]" (a
        # RAY_DEDUP_LOGS of the job's own wins).
        env = {"RAY_DEDUP_LOGS": "0", **context.env,
               **self.driver_environment(context.env, context.storage_url)}  # fmt: skip
        pids: dict[str, str] = {}  # a Train worker's pid -> its world rank, as Train set them
        for item in context.runner.run(
            self.commands, env, context.cwd, context.mask,
            before_end=context.before_end, runtime=context.runtime,
        ):  # fmt: skip
            if isinstance(item, OutputLines):
                item = OutputLines([worker_rank(line, pids) for line in item.lines], item.continues)
            yield item


WORKERS_SAID = "Ray Train workers:"  # the callback's line, from Train's controller (its pids)
_WORKER_PID = re.compile(r"rank (\d+) is pid (\d+)")
_WORKER_PREFIX = re.compile(r"\(RayTrainWorker pid=(\d+)")


def worker_rank(line: str, pids: dict[str, str]) -> str:
    """A Train worker's line with its world rank in Ray's prefix: `(RayTrainWorker rank 1
    pid=456, ip=...)`; the callback's line of the workers' pids teaches `pids`."""
    if WORKERS_SAID in line:
        pids.update({pid: rank for rank, pid in _WORKER_PID.findall(line)})
        return line
    return _WORKER_PREFIX.sub(
        lambda m: f"(RayTrainWorker rank {pids[m[1]]} pid={m[1]}" if m[1] in pids else m[0], line
    )
