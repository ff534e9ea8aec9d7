"""A checkpoint followed by the next of its series is whole, even if its writer dies at once.

A real writer process writes a checkpoint in place, starts the next one and is SIGKILLed 0.1 s
later, well inside the settle window; the uploader (used directly, no Ray) is told of the death
as the controller tells it. The older checkpoint must be stored complete unless the writer said
otherwise; the one cut off, incomplete. Local storage root: the rule is the uploader's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.node.checkpoint_rules import follows
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.records import CheckpointEntry
from orchestrator.storage.root import StorageRoot

SETTLE_S = 3.0  # the kill comes 0.1 s after the newer one starts: far inside this
KILLED = "rank 0's command was killed by SIGKILL"

# argv: the checkpoint directory, the older name, the newer name ("" for none), then the older
# one's files. The older one is written in place (no rename, no marker): only settling, or the
# newer one, can say it is whole. `hold` keeps its last file open for writing, written and
# flushed, as a writer that has not closed it yet.
WRITER = """
import os, sys, time
from pathlib import Path

root, older, newer, *files = sys.argv[1:]
hold = os.environ.get("HOLD_LAST_FILE") == "1"
held = None
d = Path(root) / older
d.mkdir()
for i, name in enumerate(files):
    data = os.urandom(50_000)
    if hold and i == len(files) - 1:
        held = open(d / name, "wb")
        held.write(data)
        held.flush()
    else:
        (d / name).write_bytes(data)
if newer:
    (Path(root) / newer).mkdir()
print(f"started {time.time()}", flush=True)
if newer:
    with open(Path(root) / newer / "model.safetensors", "wb") as f:
        while True:                      # writing the newer one when the kill comes
            f.write(os.urandom(10_000))
            f.flush()
            time.sleep(0.01)
time.sleep(3600)
"""


def uploader(tmp_path: Path) -> tuple[CheckpointUploader, StorageRoot, Path]:
    root, local = StorageRoot(tmp_path / "root"), tmp_path / "ckpts"
    local.mkdir()
    up = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": SETTLE_S}, None, {})
    assert up.ready(10)
    return up, root, local


def write_and_kill(
    tmp_path: Path,
    local: Path,
    older: str,
    newer: str,
    files: list[str],
    hold: bool = False,
    before_kill=None,
) -> float:
    """Run the writer; SIGKILL it 0.1 s after it starts `newer` (after `older`'s last file when
    there is none). Returns when it was killed, by this machine's clock."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    env = {**os.environ, "HOLD_LAST_FILE": "1" if hold else "0"}
    writer = subprocess.Popen(
        [sys.executable, str(script), str(local), older, newer, *files],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = writer.stdout.readline().split()
        assert line and line[0] == "started", "the writer did not start"
        started = float(line[1])
        if before_kill is not None:
            before_kill()
        time.sleep(max(0.0, started + 0.1 - time.time()))
        os.kill(writer.pid, signal.SIGKILL)
        killed = time.time()
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert killed - started < SETTLE_S - 1, "killed too late to be inside the settle window"
    return killed


def end(up: CheckpointUploader, killed: float) -> dict[str, CheckpointEntry]:
    """Tell the uploader its writer died, as the controller does, then flush."""
    up.writer_ended(False, KILLED, at=killed)
    result = up.flush(timeout=30, clean=False, how=KILLED)
    return {e.name: e for e in result.entries}


def stored(root: StorageRoot) -> dict[str, Manifest]:
    return {m.name: m for m in CheckpointStore(root).list("p", "j")}


def test_a_whole_checkpoint_followed_by_the_next_survives_a_sigkill_inside_settle(tmp_path):
    up, root, local = uploader(tmp_path)
    files = ["model.safetensors", "optimizer.pt", "scheduler.pt"]
    killed = write_and_kill(tmp_path, local, "checkpoint-1", "checkpoint-2", files)
    entries = end(up, killed)
    assert {n: e.state for n, e in entries.items()} == {
        "checkpoint-1": "uploaded",
        "checkpoint-2": "incomplete",
    }
    by_name = stored(root)
    whole, cut = by_name["checkpoint-1"], by_name["checkpoint-2"]
    assert whole.complete and sorted(f.path for f in whole.files) == files
    assert whole.size_bytes == 3 * 50_000
    assert not cut.complete and cut.incomplete_reason == entries["checkpoint-2"].reason
    assert (
        cut.incomplete_reason.startswith(KILLED)
        and "before it was complete" in cut.incomplete_reason
    )
    assert any(
        "checkpoint checkpoint-1 uploaded (checkpoint-2, later in its series, started after it)"
        in e
        for e in up.events
    ), up.events


def test_a_hugging_face_checkpoint_without_trainer_state_stays_incomplete(tmp_path):
    """The writer said otherwise: the Trainer writes trainer_state.json last."""
    up, root, local = uploader(tmp_path)
    files = ["config.json", "model.safetensors", "training_args.bin", "optimizer.pt"]
    killed = write_and_kill(tmp_path, local, "checkpoint-1", "checkpoint-2", files)
    entries = end(up, killed)
    assert {n: e.state for n, e in entries.items()} == {
        "checkpoint-1": "incomplete",
        "checkpoint-2": "incomplete",
    }
    assert "without trainer_state.json" in entries["checkpoint-1"].reason
    assert not stored(root)["checkpoint-1"].complete


def test_a_lone_checkpoint_killed_inside_settle_stays_incomplete(tmp_path):
    up, _, local = uploader(tmp_path)
    killed = write_and_kill(tmp_path, local, "checkpoint-1", "", ["model.safetensors", "opt.pt"])
    entries = end(up, killed)
    assert {n: e.state for n, e in entries.items()} == {"checkpoint-1": "incomplete"}
    assert entries["checkpoint-1"].reason.startswith(KILLED)


def test_another_series_does_not_vouch_for_a_checkpoint(tmp_path):
    up, _, local = uploader(tmp_path)
    killed = write_and_kill(tmp_path, local, "best", "checkpoint-2", ["model.safetensors"])
    entries = end(up, killed)
    assert {n: e.state for n, e in entries.items()} == {
        "best": "incomplete",
        "checkpoint-2": "incomplete",
    }


def test_a_file_held_open_for_writing_when_the_next_started_keeps_it_incomplete(tmp_path):
    up, _, local = uploader(tmp_path)

    def seen_started() -> None:  # the newer one must be seen while the writer lives
        deadline = time.monotonic() + 10
        while "checkpoint-2" not in up.tracked:
            assert time.monotonic() < deadline, "the uploader never saw checkpoint-2"
            time.sleep(0.01)

    files = ["model.safetensors", "optimizer.pt"]
    killed = write_and_kill(
        tmp_path, local, "checkpoint-1", "checkpoint-2", files, hold=True, before_kill=seen_started
    )
    entries = end(up, killed)
    assert {n: e.state for n, e in entries.items()} == {
        "checkpoint-1": "incomplete",
        "checkpoint-2": "incomplete",
    }


@pytest.mark.parametrize(
    ("newer", "older", "expected"),
    [
        ("checkpoint-2", "checkpoint-1", True),
        ("checkpoint-10", "checkpoint-9", True),
        ("step_200", "step_100", True),
        ("global_step0200", "global_step100", True),
        ("epoch=1-step=20.ckpt", "epoch=1-step=10.ckpt", True),
        ("epoch=2-step=20.ckpt", "epoch=1-step=10.ckpt", True),
        ("checkpoint-1", "checkpoint-2", False),
        ("checkpoint-2", "checkpoint-2", False),
        ("checkpoint-2", "best", False),
        ("best", "checkpoint-1", False),
        ("step_200", "checkpoint-100", False),
        ("run4-step-50", "run3-step-100", False),
    ],
)
def test_what_is_a_later_checkpoint_of_the_same_series(newer, older, expected):
    assert follows(newer, older) is expected
