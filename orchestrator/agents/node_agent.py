"""The node agent: prepares its node for a job, runs the start commands, and stops them.

One agent per bundle of the job's placement group. Ray gives it the bundle's resources, so
CUDA_VISIBLE_DEVICES is set for the bundle's GPUs and the commands inherit it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from orchestrator import actor_names
from orchestrator.agents.messages import (
    CacheRequest,
    CacheSeeded,
    CommandsEnded,
    Delivery,
    MetricsRequest,
    OutputLines,
    PreparedNode,
    PrepareRequest,
    StartRequest,
    WeightPlacement,
)
from orchestrator.agents.rendezvous import free_port, group_environment
from orchestrator.agents.services import NAMESPACE, actor_alive
from orchestrator.node.node_root import RankDirs
from orchestrator.node.output_splitter import OutputSplitter
from orchestrator.node.secrets import SECRET_ENV_PREFIX, SecretMasker, resolve_secret
from orchestrator.node.terminal import Terminals
from orchestrator.spec.checkpoints import DEFAULT_DOWNLOAD_FOLDER
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.local_checkpoint import EARLIER_CHECKPOINTS
from orchestrator.storage.logs import rank_line
from orchestrator.storage.root import StorageRoot

# Weights and the training cache are imported where a job uses them: every job's agent worker
# imports this module while the job waits to start (docs/performance.md).
if TYPE_CHECKING:
    from orchestrator.node.node_metrics import MetricsSampler
    from orchestrator.node.training_cache_mounts import TrainingCacheMounts
    from orchestrator.storage.metrics import RankMetrics, UploadStats

# Not RAY_ADDRESS itself: a job may start a Ray head of its own, which that name would confuse.
RAY_ADDRESS_ENV = "ORCHESTRATOR_RAY_ADDRESS"

# Runs each command as the leader of its process group. If the agent dies without stopping it
# (a killed worker, a lost node), the guard notices its parent is gone and kills the group, so
# no training process is orphaned. It ignores SIGTERM itself, so a stop reaches the command and
# the guard reports the command's own exit code.
_GUARD = """
import os, signal, subprocess, sys
agent = int(sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
restore = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # noqa: E731
child = subprocess.Popen(sys.argv[2:], preexec_fn=restore)
while True:
    try:
        child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        if os.getppid() != agent:
            os.killpg(0, signal.SIGKILL)
sys.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)
"""
LAST_LINES = 50
READ_BYTES = 64 * 1024  # one read of a command's output
READ_QUEUE_CHUNKS = 64  # reads waiting to be forwarded (4 MiB), after which the command waits
# Characters per stream item: under Ray's 100 KiB inline limit, so output never goes through the
# object store; the controller takes at most STREAM_BACKLOG items unread before the agent waits.
BATCH_CHARS = 64 * 1024
STREAM_BACKLOG = 16
SHELL_TIMEOUT_EXIT = 124  # as timeout(1)
SHELL_OUTPUT_BYTES = 8 * 2**20  # the end of a longer output is kept
TERMINAL_GROUP = "terminal"  # the agent's concurrency group for terminals
TERMINAL_THREADS = 8  # two per open terminal (its output long-poll and its input)


agent_name = actor_names.node_agent  # also what marks the weights and links an agent holds
uploader_name = actor_names.checkpoint_uploader


class NodeAgent:
    """A Ray actor (threaded, so `stop` can run while `run_commands` streams)."""

    def __init__(self, job_id: str, rank: int, storage_root: str, team: str | None = None) -> None:
        self.job_id, self.rank, self.team = job_id, rank, team
        self.storage = StorageRoot(storage_root)
        self.dirs = RankDirs.of(job_id, rank)
        self.base = self.dirs.base
        self.working_dir = self.dirs.workspace
        self.scratch_dir = self.dirs.scratch
        self.actor_name = agent_name(job_id, rank)
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._mounts: list[tuple[Path, str]] = []  # weight mounts: link -> the cache's directory
        self._cache_mounts: TrainingCacheMounts | None = None
        self._holds_weights = False  # asked this node's cache for a set: release it at the end
        # What the job's commands run with (environment with secrets, directory, masker), for
        # `orchestrator shell`: set when they start, on this node only.
        self._job_shell: tuple[dict[str, str], str, SecretMasker] | None = None
        self._terminals = Terminals()  # `orchestrator shell` without a command
        self._checkpoint_dir = self.dirs.checkpoints
        self._metrics: RankMetrics | None = None  # this rank's samples, across attempts
        self._sampler: MetricsSampler | None = None
        self._uploader: Any = None

    def node_info(self) -> dict[str, Any]:
        import ray

        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "working_dir": str(self.working_dir),
        }

    def prepare(self, request: PrepareRequest) -> PreparedNode:
        """Check secrets, fetch the code, create the job's directories, fetch checkpoints to load,
        and place the job's weight sets at their mount locations.

        Checkpoints to load land in `<folder>/rank-<their rank>/<their name>/`; Baseten's
        default folder becomes one private to this job on this node.
        """
        archive_path, sha256 = request.archive_path, request.sha256
        checkpoint_dir, load, download_folder = (
            request.checkpoint_dir,
            request.load,
            request.download_folder,
        )
        for name in request.secret_names:
            resolve_secret(name, self.team)  # a missing secret fails the deploy, naming it
        if self.working_dir.exists():
            shutil.rmtree(self.working_dir)
        self.working_dir.mkdir(parents=True)
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        local_tar = self.base / "workspace.tar"
        self.storage.get_file(archive_path, local_tar)
        digest = _sha256(local_tar)
        if digest != sha256:
            raise RuntimeError(f"code archive {archive_path} is corrupt: sha256 {digest}")
        with tarfile.open(local_tar) as tar:
            tar.extractall(self.working_dir, filter="tar")
        local_tar.unlink()
        (self.dirs.checkpoints).mkdir(exist_ok=True)
        if checkpoint_dir:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            self._checkpoint_dir = Path(checkpoint_dir)
        # Before any command runs: what a reused checkpoint_path already holds is not this job's.
        # Taken once per job on a node: a rank prepared again (its agent was lost) keeps it.
        from orchestrator.node.checkpoint_rules import (
            read_earlier_checkpoints,
            write_earlier_checkpoints,
        )

        if read_earlier_checkpoints(self.base) is None:
            write_earlier_checkpoints(Path(checkpoint_dir or self.dirs.checkpoints), self.base)
        if load and download_folder:
            store = CheckpointStore(self.storage)
            folder = (
                self.dirs.loaded_checkpoints
                if download_folder == DEFAULT_DOWNLOAD_FOLDER
                else Path(download_folder)
            )
            for manifest in map(Manifest.model_validate, load):
                dest = folder / f"rank-{manifest.node_rank}" / manifest.name
                if dest.exists():
                    shutil.rmtree(dest)
                store.download(manifest, dest)
        info = self.node_info()
        cache = self._prepare_cache(request.cache) if request.cache is not None else None
        weights = tuple(self._place_weights(w) for w in request.weights)
        return PreparedNode(**info, weights=weights, cache=cache)

    def _prepare_cache(self, request: CacheRequest) -> CacheSeeded:
        """Seed this node's copies of the caches, then link them where the job looks."""
        import ray

        from orchestrator.agents.training_cache_seeder import cache_seeder_here
        from orchestrator.node.training_cache_mounts import mount_caches

        seeder = cache_seeder_here()
        seeded = ray.get(seeder.seed.remote(self.storage.url, request.team, request.project))
        explicit_base = request.explicit_base
        base = Path(request.mount_base_path) if explicit_base else self.dirs.cache
        self._cache_mounts = mount_caches(
            base,
            seeded.project.path,
            seeded.team.path,
            request.legacy_hf,
            explicit_base,
            (self.actor_name, self.job_id),
            actor_alive,
        )
        return dataclasses.replace(seeded, env=self._cache_mounts.env)

    def _place_weights(self, placement: WeightPlacement) -> Delivery:
        """Get the set from this node's cache and show it at `mount_location` (a link, no copy)."""
        import ray

        from orchestrator.agents.weight_cache import weight_cache_here
        from orchestrator.node.mounts import place_link

        started = time.monotonic()
        self._holds_weights = True
        delivered = ray.get(
            weight_cache_here().deliver.remote(
                self.storage.url, placement.weight_set, self.actor_name
            )
        )
        mount = Path(placement.mount_location)
        holder = (self.actor_name, self.job_id)
        place_link(mount, delivered["path"], "mount_location", holder, actor_alive)
        self._mounts.append((mount, delivered["path"]))
        # The whole of it as the job sees it: asking the cache, its copy if any, and the link.
        return Delivery(
            tier=delivered["tier"],
            seconds=round(time.monotonic() - started, 4),
            bytes_copied=delivered["bytes_copied"],
            mount_location=str(mount),
            evicted=tuple(delivered.get("evicted") or ()),
            over_budget=bool(delivered.get("over_budget")),
        )

    def run_commands(self, request: StartRequest) -> Iterator[OutputLines | CommandsEnded]:
        """Join the group, then run the commands in order through a shell, stopping at a failure.

        Yields OutputLines as output arrives and finally CommandsEnded. `request.secrets` maps
        env var names to secret names, resolved here and masked in every line.
        """
        commands, env, secrets, cwd = request.commands, request.env, request.secrets, request.cwd
        gpus_per_node = request.gpus_per_node
        self._stopping.clear()  # a retried attempt on a node that ran the last one
        group = self._join(request.rendezvous)
        if group is None:  # stopped while waiting for the other ranks
            yield CommandsEnded(exit_code=0, stopped=True)
            return
        values = {var: resolve_secret(name, self.team) for var, name in secrets.items()}
        mask = SecretMasker(list(values.values()))
        group_env = group_environment(self.rank, group, gpus_per_node)
        if address := _cluster_address():
            group_env[RAY_ADDRESS_ENV] = address
        # The node's secret store (ORCHESTRATOR_SECRET_*) is not the job's to read: it gets only
        # the secrets it names, under the names it chose.
        node_env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_ENV_PREFIX)}
        cache_env = self._cache_mounts.env if self._cache_mounts else {}
        full_env = {**node_env, **cache_env, **env, **group_env, **values}
        # The node's own environment: `python`, `pip`, `torchrun` are those Ray runs with.
        full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
        self._job_shell = (full_env, cwd, mask)
        if request.metrics is not None:
            try:
                self._start_sampling(request.metrics)
            except Exception as e:  # the job runs on without its samples, saying why
                yield OutputLines([self._tag(f"resource sampling did not start: {e!r}")])
        try:
            yield from self._run_each(commands, full_env, cwd, mask)
        finally:
            self._end_sampling()  # a closed stream (otherwise it ended before the ending was said)

    def _run_each(
        self, commands: tuple[str, ...], full_env: dict[str, str], cwd: str, mask: SecretMasker
    ) -> Iterator[OutputLines | CommandsEnded]:
        last_lines: deque[str] = deque(maxlen=LAST_LINES)
        for command in commands:
            if self._stopping.is_set():
                break
            # Bounded: a command that writes faster than its output is forwarded waits on its
            # pipe, as it would on a slow terminal, instead of growing this process.
            chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=READ_QUEUE_CHUNKS)
            self._process = subprocess.Popen(
                [*_guarded(), "/bin/sh", "-c", command],
                cwd=cwd,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, so stop reaches every child
            )
            reader = threading.Thread(target=_pump, args=(self._process, chunks), daemon=True)
            reader.start()
            output = OutputSplitter(mask)
            done = False
            while not done:
                batch = _drain(chunks)
                if batch and batch[-1] is None:
                    done = True
                    batch.pop()
                now = time.monotonic()
                pieces = [p for data in batch for p in output.feed(data, now)] or output.tick(now)
                if done:
                    pieces += output.close()
                last_lines.extend(p.text for p in pieces)
                yield from _items([self._tag(p.text, p.progress) for p in pieces])
            code = self._process.wait()
            if code != 0:
                self._end_sampling()
                yield CommandsEnded(
                    exit_code=code, command=command, last_lines=list(last_lines),
                    stopped=self._stopping.is_set(), ended_at=time.time(),
                )  # fmt: skip
                return
        self._end_sampling()
        yield CommandsEnded(
            exit_code=0, last_lines=list(last_lines), stopped=self._stopping.is_set(),
            ended_at=time.time(),
        )  # fmt: skip

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
        metrics.node_id, metrics.hostname = info["node_id"], info["hostname"]
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
            metrics, self.storage.url, root_pid=self._command_pid, dirs=self._sampled_dirs,
            disk_of=self.base, gpus=gpus, uploads=uploads, gauges=gauges,
        )  # fmt: skip

    def _end_sampling(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def _command_pid(self) -> int | None:
        proc = self._process
        return proc.pid if proc is not None and proc.poll() is None else None

    def _sampled_dirs(self) -> dict[str, list[Path]]:
        cache: list[Path] = []
        if self._cache_mounts is not None:
            targets = sorted({Path(target) for _, target in self._cache_mounts.links})
            # The HF link points inside the project cache: each byte counts once.
            cache = [t for t in targets if not any(t != o and t.is_relative_to(o) for o in targets)]
        return {
            "workspace": [self.working_dir], "scratch": [self.scratch_dir],
            "checkpoints": [self._checkpoint_dir], "cache": cache,
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

    def _join(self, rendezvous: Any) -> dict[str, Any] | None:
        """Register this node's address and wait for every rank (the barrier).

        Without a rendezvous (a group of one) this node leads itself.
        """
        import ray

        if rendezvous is None:
            here = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            return {"leader_addr": here, "master_port": free_port(), "addresses": [here]}

        port = free_port() if self.rank == 0 else None
        ref = rendezvous.join.remote(self.rank, ray.util.get_node_ip_address(), port)
        while not self._stopping.is_set():
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)
        return None

    def exec_in_job(self, command: str, timeout_s: float) -> dict[str, Any]:
        """Run one shell command as the job's commands run (directory, environment, secrets);
        its exit code (124 when it ran past `timeout_s`) and output, secrets masked."""
        if self._job_shell is None:
            raise RuntimeError(f"the job's commands have not started on rank {self.rank} yet")
        env, cwd, mask = self._job_shell
        process = subprocess.Popen(
            ["/bin/sh", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = process.communicate(timeout=timeout_s)
            code = process.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            code = SHELL_TIMEOUT_EXIT
        text = out[-SHELL_OUTPUT_BYTES:].decode(errors="replace")
        return {"exit_code": code, "output": "".join(map(mask, text.splitlines(keepends=True)))}

    # Terminals have their own threads (TERMINAL_GROUP): a client long-polling for output never
    # holds up `stop` or the commands' stream.
    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_open(self, rows: int, cols: int, term: str, lost_after_s: float) -> str:
        """Start a shell on a PTY as the job's commands run (directory, environment, secrets);
        its terminal id."""
        if self._job_shell is None:
            raise RuntimeError(f"the job's commands have not started on rank {self.rank} yet")
        env, cwd, mask = self._job_shell
        return self._terminals.open(
            env=env, cwd=cwd, masker=mask, rows=rows, cols=cols, term=term,
            lost_after_s=lost_after_s,
        )  # fmt: skip

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_read(self, terminal_id: str, wait_s: float) -> tuple[bytes, int | None]:
        return self._terminals.read(terminal_id, wait_s)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_write(self, terminal_id: str, data: bytes) -> None:
        self._terminals.get(terminal_id).write(data)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_resize(self, terminal_id: str, rows: int, cols: int) -> None:
        self._terminals.get(terminal_id).resize(rows, cols)

    @ray.method(concurrency_group=TERMINAL_GROUP)
    def terminal_close(self, terminal_id: str) -> None:
        self._terminals.close(terminal_id)

    def stop(self, grace_s: float = 10.0) -> bool:
        """SIGTERM the running command's process group, SIGKILL what is left after `grace_s`.

        The whole group gets the grace, not only the shell: a trainer that saves a checkpoint
        on SIGTERM outlives the `sh -c` that started it, which SIGTERM ends at once.
        """
        self._stopping.set()
        proc = self._process
        if proc is None or proc.poll() is not None:
            return False
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        return True

    def cleanup(self, keep_checkpoints: bool = True) -> None:
        """Remove the job's scratch, working copy and loaded checkpoints from this node.

        Its own checkpoint directory goes too once every checkpoint is in the storage root.
        """
        self.stop(grace_s=0)
        self._terminals.close_all()
        self._unmount_weights()
        if self._cache_mounts is not None:
            self._cache_mounts.remove()
        shutil.rmtree(self.dirs.cache, ignore_errors=True)
        shutil.rmtree(self.scratch_dir, ignore_errors=True)
        shutil.rmtree(self.working_dir, ignore_errors=True)
        shutil.rmtree(self.dirs.loaded_checkpoints, ignore_errors=True)
        (self.base / EARLIER_CHECKPOINTS).unlink(missing_ok=True)
        if not keep_checkpoints:
            shutil.rmtree(self.dirs.checkpoints, ignore_errors=True)
        for empty in (self.dirs.checkpoints, self.base, self.base.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()

    def _unmount_weights(self) -> None:
        """Remove this job's mount links (not a later job's) and let the cache evict its sets."""
        if not self._holds_weights:
            return
        from orchestrator.agents.weight_cache import weight_cache_here
        from orchestrator.node.mounts import remove_links

        remove_links(self._mounts, (self.actor_name, self.job_id), actor_alive)
        self._mounts.clear()
        # Not waited for: the agent is about to go, and a set it held is freed either way once
        # the cache sees it gone.
        with contextlib.suppress(Exception):
            weight_cache_here().release.remote(self.actor_name)
        self._holds_weights = False

    def _tag(self, line: str, progress: bool = False) -> str:
        return rank_line(self.rank, time.strftime("%H:%M:%S"), line, progress)


def _no_uploads() -> None:
    """A job without checkpointing has no uploader to ask."""
    return None


def _cluster_address() -> str | None:
    """The GCS address of the cluster running this job, for code that joins it (Ray Train)."""
    import ray

    return str(ray.get_runtime_context().gcs_address) if ray.is_initialized() else None


def _guarded() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid())]


def _pump(proc: subprocess.Popen[bytes], chunks: queue.Queue[bytes | None]) -> None:
    """The command's output as it comes, not line by line: a progress bar or a prompt without a
    newline is read at once (node/output_splitter.py decides what to forward)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while data := os.read(fd, READ_BYTES):
        chunks.put(data)
    chunks.put(None)


def _items(lines: list[str]) -> Iterator[OutputLines]:
    """`lines` in order, in items of at most BATCH_CHARS characters; a longer line in pieces,
    each but its last alone in an item that `continues`."""
    batch: list[str] = []
    size = 0
    for line in lines:
        if batch and size + len(line) > BATCH_CHARS:
            yield OutputLines(batch)
            batch, size = [], 0
        while len(line) > BATCH_CHARS:
            yield OutputLines([line[:BATCH_CHARS]], continues=True)
            line = line[BATCH_CHARS:]
        batch.append(line)
        size += len(line)
    if batch:
        yield OutputLines(batch)


def _drain(chunks: queue.Queue[bytes | None], wait: float = 0.1, most: int = 16) -> list:
    """Block for the first chunk (up to `wait`), then take what else is ready, up to `most`
    (1 MiB: what a loop holds at once, several copies of it being made)."""
    try:
        batch = [chunks.get(timeout=wait)]
    except queue.Empty:
        return []
    while batch[-1] is not None and len(batch) < most:
        try:
            batch.append(chunks.get_nowait())
        except queue.Empty:
            break
    return batch


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
