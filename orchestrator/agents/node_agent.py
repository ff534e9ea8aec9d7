"""The node agent: the actor that prepares its node for a job, runs the start commands, and
stops them.

One agent per bundle of the job's placement group. Ray gives it the bundle's resources, so
CUDA_VISIBLE_DEVICES is set for the bundle's GPUs and the commands inherit it. The work is
done by three parts it holds: a `NodePreparer` (code, directories, checkpoints, caches,
weights), a `CommandRunner` (the commands and their output) and a `JobShellService`
(`orchestrator shell`); the agent joins the group, gives the commands their environment and
samples the rank's resources.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from orchestrator import actor_names
from orchestrator.agents.command_runner import CommandRunner
from orchestrator.agents.job_shell_service import JobShellService
from orchestrator.agents.messages import (
    CommandsEnded,
    Group,
    MetricsRequest,
    OutputLines,
    PreparedNode,
    PrepareRequest,
    ShellResult,
)
from orchestrator.agents.node_preparer import NodePreparer
from orchestrator.agents.rank_program import CLUSTER_ADDRESS_ENV, RankContext, StartRequest
from orchestrator.agents.rendezvous import free_port, group_environment
from orchestrator.agents.services import NAMESPACE
from orchestrator.node.node_root import RankDirs
from orchestrator.node.progress_beat import PROGRESS_FILE_ENV, read_beat
from orchestrator.node.secrets import SecretMasker, resolve_secret
from orchestrator.storage.logs import rank_line
from orchestrator.storage.metrics import MetricsSample
from orchestrator.storage.records import NodeInfo
from orchestrator.storage.root import StorageRoot

# Metrics are imported where a job samples them: every job's agent worker imports this module
# while the job waits to start (docs/performance.md).
if TYPE_CHECKING:
    from orchestrator.node.node_metrics import MetricsSampler
    from orchestrator.storage.metrics import RankMetrics, UploadStats

__all__ = ["TERMINAL_GROUP", "TERMINAL_THREADS", "NodeAgent", "agent_name"]

RAY_ADDRESS_ENV = CLUSTER_ADDRESS_ENV
TERMINAL_GROUP = "terminal"  # the agent's concurrency group for terminals
TERMINAL_THREADS = 8  # two per open terminal (its output long-poll and its input)

agent_name = actor_names.node_agent  # also what marks the weights and links an agent holds
uploader_name = actor_names.checkpoint_uploader
BEAT_FILE = ".orchestrator-progress"  # in the rank's scratch directory


class NodeAgent:
    """A Ray actor (threaded, so `stop` can run while `run_program` streams)."""

    def __init__(self, job_id: str, rank: int, storage_root: str, team: str | None = None) -> None:
        self.job_id, self.rank, self.team = job_id, rank, team
        self.storage = StorageRoot(storage_root)
        self.dirs = RankDirs.of(job_id, rank)
        self.actor_name = agent_name(job_id, rank)
        self.preparer = NodePreparer(self.storage, self.dirs, team, (self.actor_name, job_id))
        self.runner = CommandRunner(self._tag)
        self.shell = JobShellService(rank)
        self._metrics: RankMetrics | None = None  # this rank's samples, across attempts
        self._sampler: MetricsSampler | None = None
        self._uploader: Any = None

    def node_info(self) -> NodeInfo:
        import ray

        return NodeInfo(
            rank=self.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            working_dir=str(self.dirs.workspace),
        )

    def prepare(self, request: PrepareRequest) -> PreparedNode:
        """Make the node ready for the job's commands (agents/node_preparer.py)."""
        cache, weights = self.preparer.prepare(request)
        info = self.node_info()
        return PreparedNode(
            rank=info.rank, node_id=info.node_id, ip=info.ip, hostname=info.hostname,
            working_dir=info.working_dir, weights=weights, cache=cache,
            image_digest=self.preparer.image_digest,
        )  # fmt: skip

    def pull_progress(self) -> Iterator[str]:
        """The lines of the image's pull `prepare` makes, as they come, until it ends."""
        yield from self.preparer.pull_lines()

    def run_program(self, request: StartRequest) -> Iterator[OutputLines | CommandsEnded]:
        """Join the group, then run the rank's program (agents/rank_program.py) in the job's
        environment: its commands, for most jobs, stopping at a failure.

        Yields OutputLines as output arrives and finally CommandsEnded. `request.secrets` maps
        env var names to secret names, resolved here and masked in every line.
        """
        self.runner.stopping.clear()  # a retried attempt on a node that ran the last one
        group = self._join(request.rendezvous)
        if group is None:  # stopped while waiting for the other ranks
            yield CommandsEnded(exit_code=0, stopped=True)
            return
        values = {var: resolve_secret(name, self.team) for var, name in request.secrets.items()}
        mask = SecretMasker(list(values.values()))
        group_env = group_environment(self.rank, group, request.gpus_per_node)
        if address := _cluster_address():
            group_env[RAY_ADDRESS_ENV] = address
        mounts = self.preparer.cache_mounts
        cache_env = mounts.env if mounts else {}
        # Where the rank runs (the host, or its container: node/rank_runtime.py) and all it sees.
        runtime = request.runtime.on_node(self.preparer.place())
        env = runtime.environment({**cache_env, **request.env, **group_env, **values})
        env = {**env, **self._beat_environment(env)}
        self.shell.commands_started(env, request.cwd, mask, runtime)
        if request.metrics is not None:
            try:
                self._start_sampling(request.metrics)
            except Exception as e:  # the job runs on without its samples, saying why
                yield OutputLines([self._tag(f"resource sampling did not start: {e!r}")])
        context = RankContext(
            rank=self.rank, env=env, cwd=request.cwd, mask=mask, runner=self.runner,
            runtime=runtime, before_end=self._end_sampling, tag=self._tag,
            storage_url=self.storage.url,
        )  # fmt: skip
        try:
            yield from request.program.run(context)
        finally:
            self._end_sampling()  # a closed stream (otherwise it ended before the ending was said)

    def _start_sampling(self, request: MetricsRequest) -> None:
        """Sample this rank's resources until its commands end (node/node_metrics.py)."""
        if request.interval_s <= 0:
            return
        import ray

        from orchestrator.node.node_metrics import Gauges, MetricsSampler, no_wait_root
        from orchestrator.storage.metrics import RankMetrics, read_rank_metrics

        if self._metrics is None:  # a replacement agent goes on with what the lost one stored
            with contextlib.suppress(Exception):  # not in an outage: the commands wait for this
                root = no_wait_root(self.storage.url)
                self._metrics = read_rank_metrics(root, self.job_id, self.rank)
        info = self.node_info()
        metrics = self._metrics = self._metrics or RankMetrics(job_id=self.job_id, rank=self.rank)
        metrics.node_id, metrics.hostname = info.node_id, info.hostname
        metrics.interval_s = request.interval_s
        metrics.memory_request_bytes = request.memory_request_bytes
        metrics.cpu_request = request.cpu_request
        gauges = None
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                gauges = Gauges(self.job_id, request.project, self.rank)
        gpus = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        uploads = self._upload_stats if request.checkpointing else _no_uploads
        self._sampler = MetricsSampler(
            metrics, self.storage.url, root_pid=self.runner.pid, dirs=self._sampled_dirs,
            disk_of=self.dirs.base, gpus=gpus, uploads=uploads, gauges=gauges,
            beat=self._read_beat,
        )  # fmt: skip

    def _beat_environment(self, env: dict[str, str]) -> dict[str, str]:
        """Where `orchestrator.progress()` beats (node/progress_beat.py): a file in the rank's
        scratch directory, as the commands see it (a container's path inside it). A beat left
        by an earlier attempt is removed."""
        with contextlib.suppress(OSError):
            self._beat_file().unlink()
        if "BT_SCRATCH_DIR" not in env:
            return {}
        return {PROGRESS_FILE_ENV: f"{env['BT_SCRATCH_DIR'].rstrip('/')}/{BEAT_FILE}"}

    def _beat_file(self) -> Path:
        return self.dirs.scratch / BEAT_FILE

    def _read_beat(self) -> tuple[float, int | None] | None:
        return read_beat(str(self._beat_file()))

    def stacks(self) -> str:
        """Every Python stack of this rank's commands now (py-spy, node/stacks.py)."""
        from orchestrator.node.stacks import rank_stacks

        return rank_stacks(self.runner.pid())

    def last_sample(self) -> MetricsSample | None:
        """This rank's latest resource sample (None before the first): the controller's polls
        see whether the rank's processes still use CPU or GPUs."""
        metrics = self._metrics
        return metrics.samples[-1] if metrics is not None and metrics.samples else None

    def _end_sampling(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def _sampled_dirs(self) -> dict[str, list[Path]]:
        cache: list[Path] = []
        if (mounts := self.preparer.cache_mounts) is not None:
            targets = sorted({Path(target) for _, target in mounts.links})
            # The HF link points inside the project cache: each byte counts once.
            cache = [t for t in targets if not any(t != o and t.is_relative_to(o) for o in targets)]
        return {
            "workspace": [self.dirs.workspace], "scratch": [self.dirs.scratch],
            "checkpoints": [self.preparer.checkpoint_dir], "cache": cache,
        }  # fmt: skip

    def _upload_stats(self) -> UploadStats | None:
        """The backlog of this rank's checkpoint uploader (None while it cannot be asked)."""
        import ray

        if self._uploader is None:
            self._uploader = ray.get_actor(
                uploader_name(self.job_id, self.rank), namespace=NAMESPACE
            )
        try:
            return ray.get(self._uploader.upload_stats.remote(), timeout=2)
        except Exception:
            self._uploader = None  # restarted or gone: looked up again next time
            raise

    def _join(self, rendezvous: Any) -> Group | None:
        """Register this node's address and wait for every rank (the barrier).

        Without a rendezvous (a group of one) this node leads itself.
        """
        import ray

        if rendezvous is None:
            here = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            return Group(leader_addr=here, master_port=free_port(), addresses=(here,))

        port = free_port() if self.rank == 0 else None
        ref = rendezvous.join.remote(self.rank, ray.util.get_node_ip_address(), port)
        while not self.runner.stopping.is_set():
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)
        return None

    def exec_in_job(self, command: str, timeout_s: float) -> ShellResult:
        """Run one shell command as the job's commands run (directory, environment, secrets);
        its exit code (124 when it ran past `timeout_s`) and output, secrets masked."""
        return self.shell.exec(command, timeout_s)

    # Terminals have their own threads (TERMINAL_GROUP): a client long-polling for output never
    # holds up `stop` or the commands' stream.
    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_open(self, rows: int, cols: int, term: str, lost_after_s: float) -> str:
        """Start a shell on a PTY as the job's commands run (directory, environment, secrets);
        its terminal id."""
        return self.shell.open_terminal(rows, cols, term, lost_after_s)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_read(self, terminal_id: str, wait_s: float) -> tuple[bytes, int | None]:
        return self.shell.terminals.read(terminal_id, wait_s)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_write(self, terminal_id: str, data: bytes) -> None:
        self.shell.terminals.get(terminal_id).write(data)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_resize(self, terminal_id: str, rows: int, cols: int) -> None:
        self.shell.terminals.get(terminal_id).resize(rows, cols)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_close(self, terminal_id: str) -> None:
        self.shell.terminals.close(terminal_id)

    def stop(self, grace_s: float = 10.0) -> bool:
        """Stop the running command (its whole process group, after `grace_s`)."""
        return self.runner.stop(grace_s)

    def cleanup(self, keep_checkpoints: bool = True) -> None:
        """Remove the job's scratch, working copy and loaded checkpoints from this node.

        Its own checkpoint directory goes too once every checkpoint is in the storage root.
        """
        self.stop(grace_s=0)
        self.shell.terminals.close_all()
        self.preparer.clear(keep_checkpoints)

    def _tag(self, line: str, progress: bool = False) -> str:
        return rank_line(self.rank, time.strftime("%H:%M:%S"), line, progress)


def _no_uploads() -> None:
    """A job without checkpointing has no uploader to ask."""
    return None


def _cluster_address() -> str | None:
    """The GCS address of the cluster running this job, for code that joins it (Ray Train)."""
    import ray

    return str(ray.get_runtime_context().gcs_address) if ray.is_initialized() else None
