"""What a Ray Train job's `ray.train.report(metrics, ...)` calls said, kept with the job.

Ray Train keeps only the metrics of rounds that carried a checkpoint, and only until `fit`
returns (docs/design/ray-train.md, P5); the Train controller hands each round (one report of
every worker) to orchestrator's callback (agents/ray_train_callback.py), which adds it to a
`TrainReportWriter`. The writer stores rounds on a thread of its own, so training never waits on
storage, in parts of PART_SIZE rounds (`jobs/<id>/metrics/train-<run>-<part>.json`), each part
rewritten whole as rounds arrive: a reader sees a part before or after a write, never half of
one, and a long run costs one read per PART_SIZE rounds.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pydantic import Field

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored

PART_SIZE = 100  # rounds per stored part
MAX_KEYS = 200  # metrics kept per worker and round
MAX_TEXT = 200  # characters of a string metric, and of a name
MIN_INTERVAL_S = 1.0  # rounds arriving faster are stored together
RETRY_S = 5.0  # after a failed write

Value = int | float | str


class TrainReport(Stored):
    """One round: every worker's `ray.train.report` of one step, as Train collected it."""

    index: int  # the round's place in its run (one `fit`), from 0
    at: float  # wall clock when Train's controller had the round, seconds since the epoch
    metrics: dict[str, Value] = Field(default_factory=dict)  # the first worker's (rank 0's)
    # The other workers whose metrics differ from the first's, by their place in the round
    # (their world rank when every worker reports).
    workers: dict[int, dict[str, Value]] = Field(default_factory=dict)
    checkpoint: str | None = None  # the checkpoint directory's name, if the round saved one
    # The node ranks whose workers wrote a part of it: it is whole once each has stored its part
    parts: list[int] | None = None


class TrainRunHeader(Stored):
    """One `fit` of the job: which job, Train's run id and name, the job's attempt."""

    job_id: str
    run_id: str
    run_name: str = ""
    attempt: int = 0  # BT_RETRY_COUNT of the driver that ran it
    started_at: float

    @property
    def key(self) -> str:
        """Sorts as the runs started: the start in ms, then Train's run id."""
        return f"{round(self.started_at * 1000):013d}-{self.run_id[:12]}"


class TrainReportPart(TrainRunHeader):
    """Rounds part * PART_SIZE onwards of one run, as stored."""

    part: int
    reports: list[TrainReport] = Field(default_factory=list)


class TrainRun(TrainRunHeader):
    """One run's rounds, read back whole, by index."""

    reports: list[TrainReport] = Field(default_factory=list)


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Value]:
    """The JSON numbers and strings of one worker's metrics: nested dicts flattened (`opt/lr`),
    scalars with `.item()` (numpy, 0-d tensors) as numbers, NaN and infinities as text, a bool
    as 0 or 1, a string cut at MAX_TEXT; anything else (lists, objects) left out."""
    out: dict[str, Value] = {}
    _flatten(metrics, "", out)
    return out


def _flatten(metrics: Mapping[str, Any], prefix: str, out: dict[str, Value]) -> None:
    for key, value in metrics.items():
        if len(out) >= MAX_KEYS:
            return
        name = f"{prefix}{key}"[:MAX_TEXT]
        if isinstance(value, Mapping):
            _flatten(value, f"{name}/", out)
        elif (plain := _plain(value)) is not None:
            out[name] = plain


def _plain(value: Any) -> Value | None:
    if not isinstance(value, int | float | str) and callable(getattr(value, "item", None)):
        try:
            value = value.item()
        except Exception:  # an array of many values: not a scalar
            return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return value[:MAX_TEXT]
    return None


def train_round(index: int, at: float, per_worker: Sequence[Mapping[str, Any]],
                checkpoint: str | None, parts: list[int] | None = None) -> TrainReport:  # fmt: skip
    """A round from what Train hands `after_report`: every worker's metrics dict, in order."""
    plain = [plain_metrics(m) for m in per_worker]
    first = plain[0] if plain else {}
    workers = {i: m for i, m in enumerate(plain) if i and m != first}
    return TrainReport(index=index, at=at, metrics=first, workers=workers, checkpoint=checkpoint,
                       parts=parts)  # fmt: skip


def read_train_runs(root: StorageRoot, job_id: str) -> list[TrainRun]:
    """Every run's stored rounds, the runs as they started (empty for a job with none)."""
    parts: dict[str, list[TrainReportPart]] = {}
    for name in root.list_names(layout.metrics_dir(job_id)):
        if not (name.startswith("train-") and name.endswith(".json")):
            continue
        try:
            part = TrainReportPart.model_validate_json(
                root.read_bytes(f"{layout.metrics_dir(job_id)}/{name}")
            )
        except FileNotFoundError:
            continue
        parts.setdefault(part.key, []).append(part)
    runs = []
    for key in sorted(parts):
        found = sorted(parts[key], key=lambda p: p.part)
        rounds = {r.index: r for p in found for r in p.reports}
        header = found[0].model_dump(include=set(TrainRunHeader.model_fields))
        runs.append(TrainRun(**header, reports=[rounds[i] for i in sorted(rounds)]))
    return runs


class Writable(Protocol):
    def write_bytes(self, rel: str, data: bytes) -> None: ...


class TrainReportWriter:
    """Stores one run's rounds off the caller's thread: `add` never waits on storage; a failed
    write is said once (and its recovery once), then tried again every `retry_s`; `close` waits
    at most `timeout_s` for what is left and says what it could not store."""

    def __init__(
        self,
        root: Writable,
        header: TrainRunHeader,
        say: Callable[[str], None] | None = None,
        part_size: int = PART_SIZE,
        min_interval_s: float = MIN_INTERVAL_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.root, self.header = root, header
        self.say = say or _stderr
        self.part_size, self.min_interval_s, self.retry_s = part_size, min_interval_s, retry_s
        self._cond = threading.Condition()
        self._first = 0  # the part `_rounds` starts at: earlier parts are stored whole
        self._rounds: list[TrainReport] = []
        self._stored = 0  # rounds stored, counted from the run's first
        self._closing = self._abandoned = False
        self._failing: str | None = None  # the error being said, while writes fail
        self._thread: threading.Thread | None = None

    def add(self, report: TrainReport) -> None:
        with self._cond:
            self._rounds.append(report)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="train-report-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def close(self, timeout_s: float) -> bool:
        """Store what is left, waiting at most `timeout_s`; True when every round is stored."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        with self._cond:
            self._abandoned = True
            self._cond.notify()
            left = self._total() - self._stored
        if left:
            self.say(f"{left} Ray Train report(s) of run {self.header.run_id[:12]} not stored "
                     f"(the storage root did not answer within {timeout_s:g} s): "
                     f"{self._failing or 'still writing'}")  # fmt: skip
        return not left

    def _total(self) -> int:
        return self._first * self.part_size + len(self._rounds)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._abandoned and self._stored == self._total() and not self._closing:
                    self._cond.wait()
                if self._abandoned or self._stored == self._total():
                    return
                first, rounds, total = self._first, list(self._rounds), self._total()
                from_part = self._stored // self.part_size
            error = self._write(first, rounds, from_part)
            with self._cond:
                if error is None:
                    self._stored = total
                    done = total // self.part_size - self._first  # parts now stored whole
                    if done > 0:
                        self._rounds = self._rounds[done * self.part_size :]
                        self._first += done
                    if self._failing is not None:
                        self._failing = None
                        self.say("Ray Train reports are stored again")
                    pause = 0.0 if self._closing else self.min_interval_s
                else:
                    if self._failing is None:
                        self.say(f"Ray Train reports not stored yet ({error}); training goes on "
                                 f"and they are tried again every {self.retry_s:g} s")  # fmt: skip
                    self._failing = error
                    pause = self.retry_s
                # Rounds that arrive meanwhile wait, to be stored together; a close ends the
                # pause after a write, not the one after a failure.
                wake = time.monotonic() + pause
                while not self._abandoned and (left := wake - time.monotonic()) > 0:
                    if self._closing and self._failing is None:
                        break
                    self._cond.wait(left)

    def _write(self, first: int, rounds: list[TrainReport], from_part: int) -> str | None:
        """Write parts `from_part` onwards of the snapshot; the error in words, or None."""
        last = first + (len(rounds) - 1) // self.part_size
        try:
            for part in range(from_part, last + 1):
                start = (part - first) * self.part_size
                chunk = rounds[start : start + self.part_size]
                doc = TrainReportPart(**self.header.model_dump(), part=part, reports=chunk)
                rel = layout.train_report_part(self.header.job_id, self.header.key, part)
                self.root.write_bytes(rel, doc.model_dump_json(exclude_defaults=True).encode())
        except Exception as e:
            return f"{type(e).__name__}: {e}"[:300]
        return None


def _stderr(line: str) -> None:
    print(f"orchestrator: {line}", file=sys.stderr, flush=True)
