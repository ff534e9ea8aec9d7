"""Drives one job through its states: reserve nodes, prepare them, run, record how it ended.

Runs as the entrypoint of the job's Ray job. Every transition is written to the storage root
before the next step starts, so a reader (or a later controller) always sees the truth; while
the storage root is unreachable the job goes on and its journal stores lines and states, in
order, once it is back (storage/journal.py).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.agents.node_agent import (
    TERMINAL_GROUP,
    TERMINAL_THREADS,
    NodeAgent,
    agent_name,
)
from orchestrator.agents.rendezvous import Rendezvous
from orchestrator.agents.secret_service import start_secret_service
from orchestrator.agents.services import NAMESPACE
from orchestrator.controller.checkpointing import (
    CheckpointNotFound,
    RankEnding,
    Uploaders,
    resolve_checkpoints,
)
from orchestrator.controller.environment import job_environment
from orchestrator.controller.placement import bundles_for, describe_shortfall, strategy_for
from orchestrator.controller.session import hold_until, requested_until
from orchestrator.controller.training_cache import (
    affinity_selector,
    cache_enabled,
    cache_request,
    seeding_lines,
    seeding_status,
    write_back_line,
)
from orchestrator.controller.weights import WeightsUnavailable, mirror_weights, record_deliveries
from orchestrator.envflags import env_flag
from orchestrator.home import orchestrator_home
from orchestrator.lifecycle import CHECKPOINTS_NOT_STORED_EXIT, OUTCOME_NOT_STORED_EXIT, JobState
from orchestrator.spec.secrets import SecretReference
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.journal import JobJournal, spill_dir
from orchestrator.storage.records import (
    CacheStatus,
    Failure,
    JobRecord,
    JobStatus,
    NodeInfo,
    WeightsStatus,
)
from orchestrator.storage.retry import ON_ERROR_ENV, StorageRetry

IMAGE_URI_ENV = "ORCHESTRATOR_USE_IMAGE_URI"
POLL_S = 0.2
STOP_GRACE_S = 10.0
CACHE_AFFINITY_WAIT_S = 3.0
WRITE_BACK_S = 600.0
STOP_FLUSH_S = 40.0  # within the 60 s RAY_JOB_STOP_WAIT_TIME_S, after the commands' grace
RESULT_WAIT_S = 5.0  # for a stopped rank's result to come through its stream
STORED_WAIT_S = 10.0  # a transition waits this long to be stored (not at all in an outage)
STOPPED_CLOSE_S = 5.0  # what a stopped job's journal has left of Ray's stop grace
SESSION_POLL_S = 1.0  # a held job looks for `isession` requests and a stop this often


class JobStopped(Exception):
    """A stop was requested (SIGTERM from `ray job stop` / `orchestrator stop`)."""


class StorageLost(Exception):
    """The job's logs and status cannot be stored and ORCHESTRATOR_ON_STORAGE_ERROR=stop."""


class DeployFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


@dataclass
class _RankResult:
    rank: int
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class JobController:
    def __init__(self, store: JobStore, job_id: str, scheduling_timeout_s: float) -> None:
        self.store = store
        self.record: JobRecord = store.record(job_id)
        self.status: JobStatus = store.status(job_id)
        self.scheduling_timeout_s = scheduling_timeout_s
        self.journal = JobJournal(
            store.root, job_id, spill_dir(orchestrator_home(), job_id), self.say
        )
        # From here on, an outage is said once in the job's lines, with the job's budget.
        outage_s = self.record.storage.outage_s
        store.root.retry = StorageRetry(store.root.url, outage_s, say=self.say)
        self.unstored: list[str] = []  # what could not be stored when the job ended
        self.stop_requested = threading.Event()
        self.pg: PlacementGroup | None = None
        self.agents: list[Any] = []
        self.helpers: list[Any] = []  # the rendezvous (and later: uploaders) to end with the job
        self.rendezvous: Any = None
        self.uploaders: Uploaders | None = None
        self.weight_sets: list[dict[str, Any]] = []  # mirrored sets, in the order of `weights`
        self.cache_affinity: str | None = None
        self.results: list[_RankResult] = []  # one per rank once the commands start
        self.running_since = 0.0

    # --- state -----------------------------------------------------------------------------

    def move(self, state: JobState, reason: str | None = None, **updates: Any) -> None:
        status = self.status.moved_to(state, reason).model_copy(update=updates)
        # Lines first: a reader that sees the new state has every line written before it.
        self.say(f"{state.value}" + (f": {reason}" if reason else ""))
        self.status = status
        self.journal.status(status)
        self.journal.wait_stored(STORED_WAIT_S)

    def say(self, message: str) -> None:
        """A controller line, in the Ray job log and the stored logs."""
        line = f"[orchestrator {time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.journal.lines([line])

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise JobStopped()
        if self.journal.problem and self.record.storage.on_error == "stop":
            raise StorageLost(self.journal.problem)

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> JobState:
        if self.status.state.is_terminal:
            self.say(f"job already ended {self.status.state.value}; nothing to do")
            return self.status.state
        self.say(self._image_notice())
        try:
            if self.record.spec.job.secret_references():
                start_secret_service()  # on this node, the head: where `secrets set` writes
            self._mirror_weights()
            self._reserve()
            self._deploy()
            self._run_commands()
        except JobStopped:
            self._stop_agents()
            self._finish(JobState.STOPPED, "stopped by user")
        except StorageLost as e:
            self._stop_agents()
            cause = (
                f"stopped: the storage root {self.store.root.url} does not take the job's "
                f"logs and status ({e}), and {ON_ERROR_ENV}=stop"
            )
            self._finish(JobState.FAILED, cause, failure=Failure(cause=cause))
        except DeployFailed as e:
            self.move(JobState.DEPLOY_FAILED, e.failure.cause, failure=e.failure)
        except Exception as e:  # a bug or an infrastructure failure: record it, never hang
            failure = Failure(cause=f"controller error: {type(e).__name__}: {e}")
            state = (
                JobState.FAILED
                if self.status.state == JobState.RUNNING
                else (JobState.DEPLOY_FAILED)
            )
            self.move(state, failure.cause, failure=failure)
        finally:
            self._release()
            self._close_journal()
        return self.status.state

    def _close_journal(self) -> None:
        """Store what waits; a stopped job has only what is left of Ray's stop grace."""
        stopped = self.status.state == JobState.STOPPED
        self.unstored = self.journal.close(
            STOPPED_CLOSE_S if stopped else self.record.storage.outage_s
        )
        if self.unstored:
            line = f"could not be stored in {self.store.root.url}: " + "; ".join(self.unstored)
            print(f"[orchestrator {time.strftime('%H:%M:%S')}] {line}", flush=True)

    def _image_notice(self) -> str:
        image = self.record.spec.job.image.base_image
        if use_image_uri():
            return f"image {image}: each node runs the job in that container (Ray image_uri)"
        return (
            f"image {image} is recorded; this cluster runs jobs in each node's own environment "
            f"(set {IMAGE_URI_ENV}=1 on a cluster with a container runtime to use it)"
        )

    def _mirror_weights(self) -> None:
        """While CREATED, before any compute is reserved: every source into the mirror."""
        sources = self.record.spec.job.weights
        if not sources:
            return
        self.say(f"mirroring {len(sources)} weights source(s) into the storage root")
        try:
            self.weight_sets = mirror_weights(
                self.record.storage_root,
                self.record.team,
                sources,
                self.say,
                self._publish_weights,
                self.stop_requested.is_set,
            )
        except WeightsUnavailable as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        self._check_stop()

    def _publish_weights(self, statuses: list[WeightsStatus]) -> None:
        self.status = self.status.model_copy(update={"weights": statuses})
        self.journal.status(self.status)

    def _reserve(self) -> None:
        compute = self.record.spec.job.compute
        bundles = bundles_for(compute)
        strategy = strategy_for(compute, colocate=self.record.colocate_ranks)
        name = f"orchestrator-{self.record.job_id}"
        if self._reserve_near_cache(bundles, strategy, name):
            return
        self.pg = placement_group(bundles, strategy=strategy, name=name)
        ready = self.pg.ready()
        deadline = time.monotonic() + self.scheduling_timeout_s
        reason = None
        while True:
            done, _ = ray.wait([ready], timeout=1.0 if reason is None else POLL_S * 5)
            if done:
                return
            self._check_stop()
            new_reason = describe_shortfall(bundles[0], len(bundles), ray.nodes())
            if new_reason != reason:
                reason = new_reason
                self.move(JobState.PENDING, reason)
            if time.monotonic() > deadline:
                raise DeployFailed(
                    Failure(
                        cause=f"could not be scheduled within {self.scheduling_timeout_s:g} s: "
                        f"{reason}"
                    )
                )

    def _reserve_near_cache(self, bundles: list[dict], strategy: str, name: str) -> bool:
        """require_cache_affinity: try the nodes that hold the project's cache first, briefly."""
        selector, self.cache_affinity = affinity_selector(self.record, len(bundles))
        if selector is None:
            return False
        pg = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=selector)
        done, _ = ray.wait([pg.ready()], timeout=CACHE_AFFINITY_WAIT_S)
        if done:
            self.pg = pg
            self.cache_affinity = "placed on node(s) holding the project's cache"
            self.say(f"training cache: {self.cache_affinity}")
            return True
        remove_placement_group(pg)
        self.cache_affinity = (
            f"the node(s) holding the project's cache had no room within "
            f"{CACHE_AFFINITY_WAIT_S:g} s: placed anywhere"
        )
        self.say(f"training cache: {self.cache_affinity}")
        return False

    def _deploy(self) -> None:
        self._check_stop()
        compute = self.record.spec.job.compute
        self.move(JobState.DEPLOYING, f"preparing {compute.node_count} node(s)")
        try:
            loads = resolve_checkpoints(self.record, self.store)
        except CheckpointNotFound as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        if loads:
            names = sorted({f"{m.job_id}/{m.name}" for m in loads})
            self.say(f"loading checkpoint(s) {', '.join(names)} on every node")
        bundle = bundles_for(compute)[0]
        self.rendezvous = self._start_rendezvous(compute.node_count)
        agent_cls = ray.remote(concurrency_groups={TERMINAL_GROUP: TERMINAL_THREADS})(NodeAgent)
        image = self.record.spec.job.image.base_image
        runtime_env = {"image_uri": image} if use_image_uri() else None
        for rank in range(compute.node_count):
            self.agents.append(
                agent_cls.options(
                    name=agent_name(self.record.job_id, rank),
                    namespace=NAMESPACE,
                    max_concurrency=4,
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    memory=bundle["memory"],
                    resources={k: v for k, v in bundle.items() if k.startswith("accelerator")},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=rank
                    ),
                    runtime_env=runtime_env,
                ).remote(self.record.job_id, rank, self.record.storage_root, self.record.team)
            )
        job = self.record.spec.job
        if job.runtime.checkpointing_config.enabled:
            self.uploaders = Uploaders(self.record, self.pg, compute.node_count)
            self.helpers += self.uploaders.actors
        secret_names = sorted({ref.name for ref in job.runtime.secret_references().values()})
        archive = self.record.archive
        load_config = job.runtime.load_checkpoint_config
        load_folder = load_config.download_folder if load_config else None
        refs = [
            agent.prepare.remote(
                archive.path,
                archive.sha256,
                job.runtime.checkpointing_config.checkpoint_path,
                secret_names,
                [m.model_dump() for m in loads],
                load_folder,
                [
                    {"set": ws, "mount_location": w.normalized_mount}
                    for ws, w in zip(self.weight_sets, job.weights, strict=True)
                ],
                cache_request(self.record),
            )
            for agent in self.agents
        ]
        infos = self._gather(refs, "preparing the node")
        nodes = [NodeInfo(**i) for i in infos]
        weights = [w.model_copy(update={"nodes": []}) for w in self.status.weights]
        record_deliveries(weights, infos, self.say)
        updates: dict[str, Any] = {"nodes": nodes, "weights": weights}
        if cache_enabled(self.record):
            updates["cache"] = seeding_status(infos, self.cache_affinity)
            self._say_lines(seeding_lines(updates["cache"]))
        self.status = self.status.model_copy(update=updates)
        if self.uploaders is not None:
            self.uploaders.wait_ready()  # watching before any command runs

    def _start_rendezvous(self, group_size: int) -> Any:
        """Started with the agents, so its worker starts while they prepare, not after.

        A job of one node needs none: its agent leads itself, and one fewer worker starts.
        """
        if group_size == 1:
            return None
        rendezvous = (
            ray.remote(Rendezvous)
            .options(
                name=f"orchestrator-{self.record.job_id}-rendezvous",
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=0
                ),
            )
            .remote(group_size)
        )
        self.helpers.append(rendezvous)
        return rendezvous

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            self._check_stop()
        try:
            return ray.get(refs)
        except Exception as e:
            raise DeployFailed(Failure(cause=f"{what} failed: {_short_error(e)}")) from e

    def _run_commands(self) -> None:
        self._check_stop()
        job = self.record.spec.job
        nodes = self.status.nodes
        secrets = {
            var: ref.name
            for var, ref in job.runtime.environment_variables.items()
            if isinstance(ref, SecretReference)
        }
        results = self.results = [_RankResult(rank) for rank in range(len(self.agents))]
        self.move(JobState.RUNNING, f"running {len(job.runtime.start_commands)} command(s)")
        self.running_since = time.time()
        for node, agent, result in zip(nodes, self.agents, results, strict=True):
            stream = agent.run_commands.options(num_returns="streaming").remote(
                job.runtime.start_commands,
                job_environment(self.record, node),
                secrets,
                _workdir(node, self.record),
                self.rendezvous,
                job.compute.gpus_per_node,
            )
            threading.Thread(target=self._consume, args=(stream, result), daemon=True).start()
        over_volume = None
        while not all(r.done.is_set() for r in results):
            self._check_stop()
            failed = next((r for r in results if r.done.is_set() and _failed(r)), None)
            if failed is not None:
                break  # gang failure: one rank's failure ends the job
            if self.uploaders is not None:
                events, over_volume = self.uploaders.poll()
                self._say_lines(events)
                if over_volume:
                    break
            time.sleep(POLL_S)
        failed = next((r for r in results if r.done.is_set() and _failed(r)), None)
        if failed is None and over_volume is None:
            self._hold_for_session(failed=False, why="all commands exited 0")
            self._finish(JobState.COMPLETED, "all commands exited 0")
            return
        self._stop_agents()
        failure = _failure_of(failed) if failed is not None else Failure(cause=str(over_volume))
        self._hold_for_session(failed=True, why=failure.cause)
        self._finish(JobState.FAILED, failure.cause, failure=failure)

    def _hold_for_session(self, failed: bool, why: str) -> None:
        """Keep the nodes, their files and agents, as the interactive session asks; until its
        time is up (an `isession` request extends it) or the job is stopped."""
        session = self.record.spec.job.interactive_session
        if session is None:  # `isession` refuses such a job: nothing to read
            return
        root, job_id = self.store.root, self.record.job_id
        until = hold_until(
            session, failed, self.running_since, requested_until(root, job_id), time.time()
        )
        shown = None
        while until is not None and time.time() < until and not self.stop_requested.is_set():
            if until != shown:
                clock = time.strftime("%H:%M:%S", time.localtime(until))
                self.move(
                    JobState.RUNNING,
                    f"held for an interactive session until {clock} ({why}): orchestrator "
                    f"shell --job-id {job_id} -- CMD",
                    held_until=until,
                )
                shown = until
            time.sleep(SESSION_POLL_S)
            until = max(until, requested_until(root, job_id) or 0)
        if shown is not None:
            how = "stopped" if self.stop_requested.is_set() else "its time is up"
            self.say(f"interactive session over ({how}): releasing the nodes")
            self.status = self.status.model_copy(update={"held_until": None})

    def _finish(self, state: JobState, reason: str, **updates: Any) -> None:
        """Flush the checkpoints still on the nodes and write the cache back, then record the
        final state."""
        if self.uploaders is not None:
            self.say("uploading the checkpoints still on the nodes")
            # A stopping job has until Ray's stop grace (RAY_JOB_STOP_WAIT_TIME_S) runs out.
            timeout = STOP_FLUSH_S if state == JobState.STOPPED else None
            for result in self.results:  # stopped or ended: each result follows its exit closely
                result.done.wait(RESULT_WAIT_S)
            endings = [_ending(r, state) for r in self.results] or [
                RankEnding(rank, clean=False, how="the job ended before its commands ran")
                for rank in range(len(self.uploaders.actors))
            ]
            events, summary = self.uploaders.flush(endings, timeout)
            self._say_lines(events)
            for problem in summary.problems():  # nothing quiet: each one, with why
                self.say(f"checkpoint {problem}")
            if not summary.all_uploaded:
                missing = ", ".join([*summary.pending, *summary.failed])
                self.say(f"checkpoints not uploaded: {missing}")
                reason += f", but checkpoints were not all stored (not stored: {missing})"
            updates["checkpoints"] = summary
        if self.status.cache is not None and self.status.nodes:
            updates["cache"] = self._write_back_cache(wait=state != JobState.STOPPED)
        self.move(state, reason, **updates)

    def _write_back_cache(self, wait: bool) -> CacheStatus:
        """The leader's changes to the caches go back to the storage root, whatever the end.

        Asked of rank 0's node seeder itself, which outlives the job: a stopping job, with
        little of Ray's stop grace left, does not wait for it.
        """
        from orchestrator.agents.cache_seeder import cache_seeder_name  # jobs with a cache only

        assert self.status.cache is not None
        leader = self.status.nodes[0].node_id
        try:
            seeder = ray.get_actor(cache_seeder_name(leader), namespace=NAMESPACE)
            pending = seeder.write_back.remote(
                self.record.storage_root, self.record.team, self.record.project_key
            )
            if not wait:
                self.say("training cache: rank 0's changes are being written back")
                return self.status.cache
            result = ray.get(pending, timeout=WRITE_BACK_S)
        except Exception as e:
            error = _short_error(e)
            self.say(f"training cache not written back: {error}")
            return self.status.cache.model_copy(update={"write_back_error": error})
        total, line = write_back_line(result)
        self.say(line)
        return self.status.cache.model_copy(update={"written_back": total})

    def _say_lines(self, lines: list[str]) -> None:
        if lines:
            print("\n".join(lines), flush=True)
            self.journal.lines(lines)

    def _consume(self, stream: Any, result: _RankResult) -> None:
        try:
            for ref in stream:
                kind, payload = ray.get(ref)
                if kind == "lines":
                    sys.stdout.write("".join(line + "\n" for line in payload))
                    sys.stdout.flush()
                    self.journal.lines(payload)
                else:
                    result.result = payload
        except Exception as e:
            result.error = e
        finally:
            result.done.set()
            if self.uploaders is not None:  # from now on nothing on that node is settling
                with contextlib.suppress(Exception):
                    self.uploaders.writer_ended(_ending(result, None))

    def _stop_agents(self) -> None:
        refs = [agent.stop.remote(STOP_GRACE_S) for agent in self.agents]
        try:
            ray.get(refs, timeout=STOP_GRACE_S + 5)
        except Exception as e:
            self.say(f"stopping the commands: {_short_error(e)}")

    def _release(self) -> None:
        summary = self.status.checkpoints
        keep = summary is None or not summary.all_uploaded
        for agent in self.agents:
            with contextlib.suppress(Exception):  # a dead node's scratch went with it
                ray.get(agent.cleanup.remote(keep_checkpoints=keep), timeout=10)
            ray.kill(agent)
        for helper in self.helpers:
            ray.kill(helper)
        if self.pg is not None:
            remove_placement_group(self.pg)


def use_image_uri() -> bool:
    """Run agents in the job's base image (a cluster with podman/docker for Ray's image_uri)."""
    return env_flag(IMAGE_URI_ENV)


def _failed(result: _RankResult) -> bool:
    return result.error is not None or (result.result or {}).get("exit_code", 0) != 0


def _ending(result: _RankResult, state: JobState | None) -> RankEnding:
    """How a rank's commands ended; `state`: the job's end, for a rank still running."""
    r = result.result if result.done.is_set() else None
    if r is None:
        how = "the job was stopped" if state == JobState.STOPPED else "the job ended"
        if result.error is not None:
            how = f"rank {result.rank} was lost"
        return RankEnding(result.rank, clean=False, how=how)
    code = r["exit_code"]
    how = f"rank {result.rank}'s command exited with code {code}"
    if r.get("stopped"):
        how = f"the job was stopped (exit code {code})"
    return RankEnding(result.rank, clean=code == 0, how=how, at=r.get("ended_at"))


def _failure_of(result: _RankResult) -> Failure:
    if result.error is not None:
        return Failure(cause=f"rank {result.rank} was lost: {_short_error(result.error)}",
                       node_rank=result.rank)  # fmt: skip
    r = result.result or {}
    return Failure(
        cause=f"rank {result.rank}: command exited with code {r['exit_code']}: {r['command']}",
        exit_code=r["exit_code"],
        command=r["command"],
        node_rank=result.rank,
        last_lines=r.get("last_lines", []),
    )


def _workdir(node: NodeInfo, record: JobRecord) -> str:
    config_dir = record.archive.config_dir
    assert node.working_dir is not None
    return node.working_dir if config_dir in ("", ".") else f"{node.working_dir}/{config_dir}"


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def run_controller(job_id: str, storage_root: str, scheduling_timeout_s: float) -> int:
    """Entrypoint body: connect to the cluster, run the job, exit 0 only if it completed."""
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    controller = JobController(JobStore(storage_root), job_id, scheduling_timeout_s)

    def on_sigterm(signum: int, frame: Any) -> None:
        controller.stop_requested.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    final = controller.run()
    if final != JobState.COMPLETED:
        return 1
    if controller.unstored:
        return OUTCOME_NOT_STORED_EXIT
    summary = controller.status.checkpoints
    # The commands succeeded but not every checkpoint was stored: not a plain success in Ray's
    # eyes either (the dashboard shows the job FAILED with this code, `ray job submit` exits 1).
    return CHECKPOINTS_NOT_STORED_EXIT if summary and not summary.all_uploaded else 0
