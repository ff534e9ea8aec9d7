"""A stuck attempt (`StuckWatcher`): a rank on which nothing moved for its window.

Progress is read from what every job already produces, as each poll carries it (`RankPoll`):
its output lines (a `\\r` progress bar's updates count), its uploader's stored checkpoints, and
its resource samples: its processes' CPU time, its GPUs' utilisation, bytes written under its
checkpoint directory, the uploads made, and the explicit beat of `orchestrator.progress(step)`.

A rank is *silent* when none of them moved for its window: the larger of the job's
`stuck_after_s` (ORCHESTRATOR_STUCK_AFTER_S, 600 s) and 5x the longest silence any rank of the
attempt showed after its first output, so a slow first epoch, a long evaluation or a big
checkpoint save of a healthy job is not called stuck. `ProgressTracker` is that rule alone,
pure (tests/test_stuck.py); the watcher then takes every rank's stacks (node/stacks.py), stores
them with the job (storage/stacks.py) and ends the attempt with a `STUCK` fault.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator import settings
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.rank_group import GroupPoll, RankPoll, RankState
from orchestrator.controller.watchers import WatchScope, register
from orchestrator.storage.metrics import MetricsSample

SILENCE_FACTOR = 5.0  # a window is at least this many times the longest silence seen
CPU_MOVED_CORES = 0.05  # a sample's CPU use at or above this is progress (an idle process: ~0)
GPU_MOVED_PCT = 5.0  # a GPU's utilisation at or above this is progress
STACKS_WAIT_S = 5.0  # every rank's stacks are taken within this


@dataclass
class RankProgress:
    """What the tracker knows of one rank."""

    last_moved: float  # epoch seconds: the attempt's start until something moved
    last_exact: float = 0.0  # the last move known to the second (output, checkpoint, beat)
    printed: bool = False  # its first output has come: silences count from then
    seen_output: float | None = None
    seen_checkpoint: tuple[str, float] | None = None
    seen_sample: MetricsSample | None = None
    why: str = "nothing yet"  # what moved last


@dataclass
class ProgressTracker:
    """Each rank's last progress and the job's longest silence, fed one poll at a time."""

    stuck_after_s: float
    started: float  # epoch seconds: the attempt's start
    longest_silence: float = 0.0
    ranks: dict[int, RankProgress] = field(default_factory=dict)

    @property
    def window_s(self) -> float:
        return max(self.stuck_after_s, SILENCE_FACTOR * self.longest_silence)

    def observe(self, poll: GroupPoll) -> None:
        for rank in poll.ranks:
            progress = self.ranks.setdefault(rank.rank, RankProgress(self.started))
            for at, since, why in _moves(rank, progress):
                self._moved(progress, at, since, why)

    def silent(self, poll: GroupPoll) -> list[int]:
        """The running ranks silent for longer than the window, the first to go silent first:
        by its last output, checkpoint or beat (a sample's CPU is known only to its interval,
        and every rank of a hung collective stops using it at about the same time)."""
        window = self.window_s
        late = [
            (self.ranks[r.rank].last_exact or self.ranks[r.rank].last_moved, r.rank)
            for r in poll.ranks
            if r.state == RankState.RUNNING
            and r.rank in self.ranks
            and poll.at - self.ranks[r.rank].last_moved > window
        ]
        return [rank for _, rank in sorted(late)]

    def _moved(self, progress: RankProgress, at: float, since: float, why: str) -> None:
        """Something moved at `at`, or as early as `since` (a sample's CPU was used somewhere
        in the interval it covers): the rank is alive until `at`, and the silence it ended is
        counted to `since`, so that what a hung rank did just before it hung, seen in the next
        sample, does not widen the window."""
        if at <= progress.last_moved:
            return
        if progress.printed:
            silence = max(0.0, since - progress.last_moved)
            self.longest_silence = max(self.longest_silence, silence)
        progress.last_moved, progress.why = at, why
        if since == at:
            progress.last_exact = at
        if why == "output":
            progress.printed = True


def _moves(rank: RankPoll, seen: RankProgress) -> list[tuple[float, float, str]]:
    """What moved on `rank` since the last poll, oldest first: when (epoch seconds), as early
    as when, and what."""
    moves: list[tuple[float, float, str]] = []
    if (out := rank.last_output_at) is not None and out != seen.seen_output:
        seen.seen_output = out
        moves.append((out, out, "output"))
    stored = rank.last_checkpoint
    if stored is not None and (stored.name, stored.at) != seen.seen_checkpoint:
        seen.seen_checkpoint = (stored.name, stored.at)
        moves.append((stored.at, stored.at, "a checkpoint stored"))
    sample, before = rank.last_sample, seen.seen_sample
    if sample is not None and (before is None or sample.at > before.at):
        seen.seen_sample = sample
        moves += _sample_moves(sample, before)
    return sorted(moves)


def _sample_moves(
    sample: MetricsSample, before: MetricsSample | None
) -> list[tuple[float, float, str]]:
    """What a new sample shows moved: over the interval since the sample `before` (the first
    sample: no silence is counted before it), or, for the beat, exactly when."""
    at, since = sample.at, before.at if before is not None else 0.0
    moved = []
    if sample.cpu_cores >= CPU_MOVED_CORES:
        moved.append((at, since, f"CPU ({sample.cpu_cores:g} cores)"))
    if any(gpu.utilization_pct >= GPU_MOVED_PCT for gpu in sample.gpus):
        moved.append((at, since, "GPU utilisation"))
    if before is not None:
        if sample.disk_bytes.get("checkpoints") != before.disk_bytes.get("checkpoints"):
            moved.append((at, since, "checkpoint writes"))
        uploaded = sample.uploads.uploaded if sample.uploads else 0
        if uploaded != (before.uploads.uploaded if before.uploads else 0):
            moved.append((at, since, "checkpoint uploads"))
    beat = sample.beat_at
    if beat is not None and (before is None or beat != before.beat_at):
        moved.append((beat, beat, f"orchestrator.progress({sample.beat_step})"))
    return moved


def stuck_after_s(scope: WatchScope) -> float:
    """The job's own `stuck_after_s` (config), else ORCHESTRATOR_STUCK_AFTER_S."""
    own = scope.job.record.spec.job.stuck_after_s
    return own if own is not None else settings.STUCK_AFTER_S.get()


@register
class StuckWatcher:
    """A rank silent for its window: every rank's stacks taken and stored, then STUCK."""

    def __init__(self, scope: WatchScope) -> None:
        self.scope = scope
        self.tracker = ProgressTracker(stuck_after_s(scope), time.time())

    def watch(self, poll: GroupPoll) -> Fault | None:
        self.tracker.observe(poll)
        silent = self.tracker.silent(poll)
        if not silent:
            return None
        first = silent[0]
        progress = self.tracker.ranks[first]
        quiet = poll.at - progress.last_moved
        job = self.scope.job
        job.say(
            f"rank {first} is silent: nothing moved for {quiet:.0f} s (its window "
            f"{self.tracker.window_s:.0f} s; last progress: {progress.why}); taking every "
            "rank's stacks"
        )
        where = self._store_stacks(first, silent, quiet)
        why = (
            f"stuck: rank {first} made no progress for {quiet:.0f} s (window "
            f"{self.tracker.window_s:.0f} s: no output, CPU, GPU, checkpoint or "
            f"orchestrator.progress()); every rank's stacks: {where}"
        )
        node_id = self.scope.port.nodes.group.node_ids.get(first)
        return Fault(FaultKind.STUCK, why, first, node_id, checkpoint=_newest_checkpoint(poll))

    def _store_stacks(self, first: int, silent: list[int], quiet: float) -> str:
        from orchestrator.storage.stacks import StackStore

        job = self.scope.job
        attempt = max(len(job.status.attempts) - 1, 0)
        started = time.monotonic()
        try:
            stacks = self.scope.port.nodes.group.stacks(STACKS_WAIT_S)
        except Exception as e:  # the decision does not wait on the stacks
            stacks = {}
            job.say(f"the ranks' stacks could not be taken: {type(e).__name__}: {e}")
        taken_s = time.monotonic() - started
        for line in _refusals(job.record.job_id, stacks):
            job.say(line)
        store = StackStore(job.root, job.record.job_id)
        try:
            where = store.store(f"attempt-{attempt}", stacks, first, silent, quiet)
        except Exception as e:
            job.say(f"the ranks' stacks could not be stored: {type(e).__name__}: {e}")
            return "not stored"
        job.say(f"stacks of {len(stacks)} rank(s) taken in {taken_s:.1f} s, stored in {where}")
        return where


_REFUSED = "py-spy could not attach"
_said_refused: set[str] = set()


def _refusals(job_id: str, stacks: dict[int, str]) -> list[str]:
    """The line that py-spy may not attach (no ptrace permission), once a job."""
    refused = [r for r, text in sorted(stacks.items()) if _REFUSED in text]
    if not refused or job_id in _said_refused:
        return []
    _said_refused.add(job_id)
    return [
        f"rank(s) {', '.join(map(str, refused))}: py-spy may not attach to the commands' "
        "processes (ptrace refused: run the nodes with CAP_SYS_PTRACE or "
        "kernel.yama.ptrace_scope=0); stuck ranks are still found and acted on"
    ]


def _newest_checkpoint(poll: GroupPoll) -> str | None:
    stored = [r.last_checkpoint for r in poll.ranks if r.last_checkpoint is not None]
    if not stored:
        return None
    newest = max(stored, key=lambda s: s.at)
    return f"{newest.name} (stored at {newest.at:.3f})"  # a rewritten one is another
