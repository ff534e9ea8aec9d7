"""The checkpoint uploader: a Ray actor per node, a process apart from the training.

It watches the rank's `$BT_CHECKPOINT_DIR` and uploads each checkpoint once it is complete,
as a new version that replaces the last in one write. Training never waits on it: it only
reads. Its rules (what is a checkpoint, when it is complete, what is an earlier job's, what
happens on delete and rewrite) are in docs/architecture.md#the-checkpoint-uploader.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from orchestrator.agents.messages import EventCursor, StoredCheckpoint, UploaderFlush, UploaderPoll
from orchestrator.node import train_checkpoints
from orchestrator.node.checkpoint_rules import read_earlier_checkpoints, top_level, volume_use
from orchestrator.node.checkpoint_tracking import RENAMED, SETTLED, CheckpointTracker, Tracked
from orchestrator.node.node_root import RankDirs
from orchestrator.node.rename_watch import RenameWatch
from orchestrator.storage.checkpoints import (
    CheckpointChanged,
    CheckpointStore,
    Manifest,
    UploadSettings,
)
from orchestrator.storage.metrics import UploadStats
from orchestrator.storage.retry import StorageRetry, describe, is_transient
from orchestrator.storage.root import StorageRoot

SCAN_S = 0.1
RECHECK_S = 2.0  # how often volume size, stored and earlier jobs' checkpoints are looked at again
RETRY_S = 10.0  # a failed upload is tried again this long after, and by the final flush


class CheckpointUploader:
    """The actor: a thread that scans the directory every SCAN_S and uploads what the tracker
    (node/checkpoint_tracking.py) judges complete, and the calls the controller makes."""

    def __init__(
        self,
        project: str,
        job_id: str,
        rank: int,
        storage_root: str,
        local_dir: str | None,
        settings: dict[str, Any],
        volume_size_gib: int | None = None,
        earlier: dict[str, str] | None = None,
        outage_s: float | None = None,
        train_run: bool = False,
    ) -> None:
        """`local_dir`: checkpoint_path, or None for the rank's own directory on this node.
        `earlier`: name -> fingerprint of what it held when the job started; None: what the
        node agent writes while it prepares (started with the agent, this waits for that).
        `outage_s`: how long uploads ride out an unreachable storage root (the job's setting).
        `train_run`: a Ray Train job's, whose directories are complete once Train commits them."""
        self.project, self.job_id, self.rank = project, job_id, rank
        self.events: list[str] = []
        self.incarnation = uuid.uuid4().hex  # a restarted uploader's events are a new list
        retry = StorageRetry(storage_root, outage_s, say=self._event)
        self.store = CheckpointStore(StorageRoot(storage_root, retry))
        self.dirs = dirs = RankDirs.of(job_id, rank)
        self.job_dir = dirs.base
        self.local_dir = Path(local_dir) if local_dir else dirs.checkpoints
        self.settings = UploadSettings.model_validate(settings)
        self.volume_bytes = volume_size_gib * 2**30 if volume_size_gib else None
        self.tracker = CheckpointTracker(rank, self.local_dir, self.settings, self._event)
        self.tracker.earlier = dict(earlier or {})
        self.tracker.commit_only = train_run
        if _restarted():  # its rank's commands may not run now: no quiet spell till an attempt
            self.tracker.quiet_since = None  # begins (begin_attempt)
        self._scan_error: str | None = None
        self.over_volume: str | None = None
        self._warned = False
        self._renames: RenameWatch | None = None
        self._started = threading.Event()  # watching: the baseline is known, renames are seen
        self._last_recheck = 0.0
        self._scans_done = 0  # scans finished (polled): the tracker counts those begun
        self._last_stored: StoredCheckpoint | None = None  # the newest stored complete
        self._attempt = 0  # begun (begin_attempt): a late writer_ended of an earlier is dropped
        self._lock = threading.Lock()  # one scan (and upload) at a time
        self._done = UploadStats()  # what this uploader has stored (the backlog is worked out)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(earlier,), daemon=True)
        self._thread.start()

    @property
    def tracked(self) -> dict[str, Tracked]:
        """Every checkpoint name met so far (the tracker's)."""
        return self.tracker.tracked

    # --- called by the controller ------------------------------------------------------------

    def ready(self, timeout: float = 60) -> bool:
        """Whether it watches the directory yet (waits up to `timeout` s): the controller
        starts the commands only then."""
        return self._started.wait(timeout)

    def poll(self, since: EventCursor | None = None) -> UploaderPoll:
        """Events after the cursor `since` (all when it is another incarnation's), and whether
        the directory is over its volume size."""
        start = since.start_in(self.incarnation) if since is not None else 0
        return UploaderPoll(
            self.events[start:], EventCursor(self.incarnation, len(self.events)),
            self.over_volume, self._scans_done,
            self._last_stored, self.tracker.writes(),
        )  # fmt: skip

    def upload_stats(self) -> UploadStats:
        """The backlog now and what was uploaded: the node agent samples it beside the rank's
        resources. Waiting: checkpoints not stored as they are that are complete, failed to
        upload, or quiet for settle_s (one whose first storage lookup waits out an outage)."""
        now, waiting = time.time(), self.tracker.waiting()
        oldest = min((t.ready_wall or t.changed_wall for t in waiting), default=None)
        return self._done.model_copy(update={
            "waiting": len(waiting),
            "waiting_bytes": sum(t.seen.size for t in waiting if t.seen is not None),
            "oldest_waiting_s": None if oldest is None else round(now - oldest, 1),
        })  # fmt: skip

    def writer_ended(
        self, clean: bool, how: str, at: float | None = None, attempt: int | None = None
    ) -> None:
        """The rank's commands ended (`clean`: the last one exited 0): from now on a checkpoint
        is complete only by what its writer left (a later one of its series started after it
        counts), never because it has been quiet. Those of an attempt before the one begun
        (told late: a lost node's) are not this attempt's writer."""
        if attempt is not None and attempt < self._attempt:
            return
        if self.tracker.writer_end is None:
            self.tracker.writer_end = (clean, at or time.time(), how)

    def train_committed(self, name: str, parts: list[int]) -> None:
        """Ray Train committed `name` (every worker reported that round; `parts`: the nodes
        with a part): this node's part, if any, is complete, marked so on disk."""
        if train_checkpoints.mark_committed(self.local_dir, name, parts):
            self._event(f"Ray Train committed {name}: this node's part of it is uploaded")

    def flush(
        self, timeout: float | None = None, clean: bool = False, how: str = "the job ended"
    ) -> UploaderFlush:
        """Upload everything still local (the commands have ended) within `timeout` seconds;
        what became of every name found, and the events. The watch ends."""
        self.writer_ended(clean, how)  # before the watch's last scan can judge a settle
        self._stop.set()
        self._thread.join(timeout=5)
        result = self.end_attempt(timeout or self.settings.flush_timeout_s, clean, how)
        if self._renames is not None:
            self._renames.close()
        return result

    def end_attempt(self, timeout: float, clean: bool, how: str) -> UploaderFlush:
        """An attempt's commands ended but the job goes on: upload what they left within
        `timeout` (an unfinished checkpoint as INCOMPLETE), and keep watching for the next."""
        self.writer_ended(clean, how)
        deadline = time.monotonic() + timeout
        retry = self.store.root.retry
        retry.give_up_at = deadline
        try:
            if self._started.is_set():
                self._scan(final=True, deadline=deadline)
        finally:
            retry.give_up_at = None
        return UploaderFlush(self.tracker.entries(), self.events, self.tracker.writes(),
                             self.incarnation)  # fmt: skip

    def begin_attempt(
        self, number: int, resume: Manifest | None, newer: list[str], top: Manifest | None = None,
        parts: Sequence[Manifest] = (), train_snapshot: str | None = None,
    ) -> None:  # fmt: skip
        """Before attempt `number` starts, put this rank at the job's resume point: set aside
        what the last attempt left unfinished, the `newer` checkpoints (those other ranks lack,
        or all when the job starts again) and copies restored for an earlier attempt, so a
        trainer resuming from its newest checkpoint finds the one every rank has; and restore
        `resume` (this rank's copy, or a shared one: controller/resume_point.py) if it is not
        here, and `top`, the files at the top that come with a directory `resume`, likewise.
        Ray Train's: the other nodes' `parts` of `resume` go beside this node's, and its run
        snapshot is `train_snapshot` (node/train_checkpoints.py). What the rank writes from
        now on is this attempt's (`tracker.writes`)."""
        if not self._started.wait(60):
            raise TimeoutError(f"rank {self.rank}'s checkpoint uploader is not watching")
        with self._lock:
            self._attempt = number
            self.tracker.writer_end = None
            kept = tuple(m.name for m in (resume, top) if m is not None)
            self._set_aside(number, set(newer), kept)
            for chosen in (resume, top):
                if chosen is not None and not self.tracker.exists(chosen.name):
                    self._restore(number, chosen)
            if parts:
                self._merge(number, list(parts))
            if train_snapshot is not None:
                said = train_checkpoints.write_snapshot(self.local_dir, train_snapshot, number)
                if said:
                    self._event(said)
            self.tracker.new_watch()

    def _merge(self, number: int, parts: list[Manifest]) -> None:
        """Other nodes' parts of a Ray Train checkpoint beside this node's, kept as restored."""
        name = parts[0].name
        train_checkpoints.merge_parts(self.store, self.local_dir, parts)
        fingerprint = self.tracker.places.snapshot(name).fingerprint
        t, whose = self.tracker.tracked.get(name), ", ".join(f"rank-{p.node_rank}" for p in parts)
        if t is not None and t.stored is not None:
            t.restored, t.seen, t.ready = fingerprint, None, None
        else:
            self.tracker.restored[name] = (fingerprint, f"{whose}/{name}")
        self._event(f"{name}: the parts of {whose} put beside this node's for attempt {number}")

    def _restore(self, number: int, chosen: Manifest) -> None:
        name, whose = chosen.name, f"rank-{chosen.node_rank}/{chosen.name}"
        places = self.tracker.places
        self.store.download(chosen, places.restore_target(name, chosen.top_level))
        fingerprint = places.snapshot(name).fingerprint
        if chosen.node_rank == self.rank:
            t = self.tracker.tracked.setdefault(name, Tracked())
            t.stored, t.looked_up, t.restored, t.gone = chosen, True, fingerprint, None
            t.seen, t.ready, t.cut_off = None, None, None
        else:
            self.tracker.restored[name] = (fingerprint, whose)
        self._event(
            f"restored {whose} from the storage root into $BT_CHECKPOINT_DIR for attempt "
            f"{number}: {len(chosen.files)} files, {chosen.size_bytes / 1e6:.1f} MB"
        )

    def _set_aside(self, number: int, newer: set[str], kept: tuple[str, ...]) -> None:
        """Move out of the directory, to `set-aside/attempt-<number>/` in the rank's (kept on the
        node; their stored copies stay): checkpoints not stored complete (an interrupted
        save), those newer than the job's resume point, and other ranks' copies restored for
        an earlier attempt (the resume point may have moved back)."""
        aside = self.tracker.to_set_aside(number, newer, kept)
        resume = kept[0] if kept else None
        for name, why, tracked in aside:
            place = self.dirs.set_aside(number) / name
            self.tracker.places.move(name, place)
            self._event(f"{name} moved to {place}: {why}; attempt {number} resumes from "
                        f"{resume or 'the start'}")  # fmt: skip
            if tracked is None:
                del self.tracker.restored[name]
            else:
                tracked.gone = f"set aside before attempt {number}: {why}"

    # --- the watch loop ----------------------------------------------------------------------

    def _watch(self, earlier: dict[str, str] | None) -> None:
        while earlier is None and not self._stop.is_set():
            earlier = read_earlier_checkpoints(self.job_dir)
            if earlier is None:
                time.sleep(SCAN_S)
        self.tracker.earlier = dict(earlier or {})
        self.tracker.places.choose(self.dirs.top_level_name, self._event)
        self._renames = RenameWatch(self.local_dir)
        self._started.set()
        while not self._stop.wait(SCAN_S):
            try:
                self._scan(final=False)
                self._scan_error = None
            except Exception as e:  # keep watching; the final flush reports what is left
                if describe(e) != self._scan_error:  # each new error once, not every scan
                    self._scan_error = describe(e)
                    self._event(f"checkpoint scan failed: {self._scan_error}")

    def _scan(self, final: bool, deadline: float | None = None) -> None:
        with self._lock:
            now = time.monotonic()
            recheck = final or now - self._last_recheck >= RECHECK_S
            if recheck:
                self._last_recheck = now
                self._check_volume()
            renamed = self._renames.renamed() if self._renames else set()
            appeared = self._renames.appeared() if self._renames else set()
            listed_at = time.time()
            places = self.tracker.places
            entries = places.kinds(top_level(self.local_dir, self.settings.temporary_patterns))
            self.tracker.notice(entries, appeared - set(entries))
            self.tracker.notice_writing(entries, appeared, listed_at)
            if self.tracker.writer_end is not None:
                self._distrust_late_settles()
            for name in places.checkpoints(entries):
                if deadline is not None and time.monotonic() > deadline:
                    self._event(f"checkpoint flush deadline passed; {name} not uploaded")
                    return
                try:
                    self._consider(name, recheck, name in renamed, final)
                except FileNotFoundError:
                    continue  # deleted while looked at: the next scan says so
            self._scans_done += 1

    def _consider(self, name: str, recheck: bool, renamed: bool, final: bool) -> None:
        """Look at one checkpoint and upload it if it is complete and not stored as it is."""
        look = self.tracker.places.snapshot
        if name in self.tracker.restored:
            fingerprint, whose = self.tracker.restored[name]
            if not (recheck or renamed) or look(name).fingerprint == fingerprint:
                return  # another rank's copy, restored for a retried attempt
            del self.tracker.restored[name]
            self._event(f"{name} (restored from {whose}) was changed by this job: it is "
                        f"rank {self.rank}'s now")  # fmt: skip
        if name in self.tracker.earlier:
            if not (recheck or renamed):
                return  # an earlier job's: looked at again every RECHECK_S
            if look(name).fingerprint == self.tracker.earlier[name]:
                if name not in self.tracker.said_earlier:
                    self.tracker.said_earlier.add(name)
                    self._event(f"skipping {name}: it was in the checkpoint directory before "
                                "this job started (an earlier job's)")  # fmt: skip
                return
            del self.tracker.earlier[name]
            self._event(f"{name} was changed by this job: it is this job's now")
        t = self.tracker.tracked.setdefault(name, Tracked())
        if not (recheck or renamed) and t.seen is not None and self.tracker.is_current(t):
            return  # stored as it is; looked at again every RECHECK_S
        seen = look(name)
        now = time.monotonic()
        if t.seen is None or seen.fingerprint != t.seen.fingerprint:
            t.seen, t.changed_at, t.changed_wall, t.ready = seen, now, time.time(), None
            t.cut_off = None
            t.changed_scan = self.tracker.scans
        if not t.looked_up:
            t.looked_up = True  # a restarted uploader finds what it committed before
            try:
                t.stored = self.store.manifest(self.project, self.job_id, self.rank, name)
            except Exception:  # a root that refuses the lookup refuses the upload: it says why
                t.stored = None
        for rel, why in seen.skipped_links:
            self.tracker.once(t, f"link {rel}", f"{name}: skipped link {rel}: {why}")
        if self.tracker.is_current(t) or not seen.files:
            return  # stored as it is, or empty: a directory made first and filled later
        if renamed:
            self.tracker.ready(t, RENAMED)
        elif t.ready is None:
            self.tracker.ready(t, self.tracker.judge(name, t, now))
        if t.ready is None and not final:
            return
        if t.ready is None and self.tracker.awaits_commit(name):
            t.uncommitted = ("Ray Train never committed it (not every worker reported that "
                             "round): not uploaded")  # fmt: skip
            return
        if t.failed and not final and now - t.failed_at < RETRY_S:
            return
        incomplete = None if t.ready else self.tracker.why_incomplete(name, t)
        if incomplete and t.stored is not None and t.stored.complete:
            self.tracker.keep_stored(name, t, incomplete)
            return
        self._upload(name, t, incomplete)

    def _distrust_late_settles(self) -> None:
        """A checkpoint judged settled after its writer died had not been quiet for settle_s
        while the writer lived: take the judgment back (and mark a stored copy incomplete)."""
        assert self.tracker.writer_end is not None
        clean, ended, _ = self.tracker.writer_end
        for name, t in self.tracker.tracked.items():
            late = t.ready == SETTLED and t.ready_wall > ended
            if clean or not late or ended - t.changed_wall >= self.settings.settle_s:
                continue
            if self.tracker.followed(name, t) is not None:
                continue  # whole all the same: a later one of its series was started after it
            t.ready = None
            if self.tracker.is_current(t) and t.stored is not None and t.stored.complete:
                why = self.tracker.why_incomplete(name, t)
                t.stored = self.store.mark_incomplete(t.stored, why)
                self._event(f"checkpoint {name} marked INCOMPLETE: {why}")

    # --- uploading -----------------------------------------------------------------------------

    def _upload(self, name: str, t: Tracked, incomplete: str | None) -> None:
        assert t.seen is not None
        start = time.monotonic()
        replaced = t.stored
        try:
            manifest = self.store.upload(
                self.local_dir / name, self.project, self.job_id, self.rank, self.settings,
                seen=t.seen, replaces=replaced, incomplete_reason=incomplete, name=name,
                top_level=self.tracker.places.is_top(name),
                train_parts=train_checkpoints.committed_parts(self.local_dir / name),
            )  # fmt: skip
        except CheckpointChanged as e:
            self._abandoned(name, t, str(e))
            return
        except Exception as e:
            t.failed, t.failed_at = describe(e), time.monotonic()
            kind = "transient" if is_transient(e) else type(e).__name__
            if kind != t.failed_said:  # an error that repeats is said once
                t.failed_said = kind
                self._event(
                    f"checkpoint {name} could not be uploaded ({t.failed}): it stays on the "
                    f"node and is tried again every {RETRY_S:g} s and when the job ends"
                )
            return
        t.stored, t.failed, t.failed_said = manifest, None, None
        if not incomplete:
            self._last_stored = StoredCheckpoint(name, time.time())
        took = time.monotonic() - start
        done, size = self._done, manifest.size_bytes
        self._done = done.model_copy(update={
            "uploaded": done.uploaded + 1, "uploaded_bytes": done.uploaded_bytes + size,
            "upload_seconds": round(done.upload_seconds + took, 3), "last_upload_s": round(took, 3),
        })  # fmt: skip
        how = f"stored as INCOMPLETE: {incomplete}" if incomplete else f"uploaded ({t.ready})"
        if replaced is not None and not incomplete:
            how = (f"uploaded again ({t.ready}; version {manifest.version} replaces version "
                   f"{replaced.version or 1})")  # fmt: skip
        self._event(
            f"checkpoint {name} {how}: {len(manifest.files)} files, "
            f"{manifest.size_bytes / 1e6:.1f} MB in {took:.2f} s"
        )
        if self.settings.delete_local and not incomplete:
            self.tracker.places.remove(name, t.seen)

    def _abandoned(self, name: str, t: Tracked, why: str) -> None:
        """A file changed or vanished mid-upload: nothing of that upload is kept."""
        kept = f"; version {t.stored.version or 1} stays stored" if t.stored else ""
        if self.tracker.exists(name):
            t.seen, t.ready = None, None  # seen afresh, and uploaded once complete again
            t.failed, t.failed_at = f"it changed during its upload ({why})", 0.0
            self._event(f"checkpoint {name} changed during its upload ({why}): upload "
                        f"abandoned{kept}; it is uploaded again once complete")  # fmt: skip
            return
        t.gone = f"deleted by the job during its upload ({why}){kept}"
        self._event(
            f"checkpoint {name} was deleted during its upload (a trainer's save_total_limit?): "
            f"upload abandoned, nothing partial kept{kept}"
        )

    def _check_volume(self) -> None:
        if self.volume_bytes is None:
            return
        self.over_volume, warning = volume_use(self.local_dir, self.rank, self.volume_bytes)
        if warning and not self._warned:
            self._warned = True
            self._event(warning)

    def _event(self, message: str) -> None:
        self.events.append(f"[rank {self.rank} {time.strftime('%H:%M:%S')}] [checkpoints] "
                           f"{message}")  # fmt: skip


def _restarted() -> bool:
    """Whether Ray restarted this uploader (its node was lost, or it was killed): its rank's
    commands may or may not run now."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)
