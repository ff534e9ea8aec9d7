"""Where a retried attempt resumes: the newest checkpoint every writing rank stored complete.

`resume_point` reads only the job's manifests; they are given here as the store lists them.
"""

from __future__ import annotations

from orchestrator.controller.checkpointing import resume_point
from orchestrator.storage.checkpoints import Manifest


class Listed:
    """The job's committed manifests, as CheckpointStore.list returns them."""

    def __init__(self, *manifests: Manifest) -> None:
        self.manifests = list(manifests)

    def list(self, project: str, job_id: str) -> list[Manifest]:
        assert (project, job_id) == ("proj", "job1")
        return sorted(self.manifests, key=lambda m: (m.created_at, m.node_rank))


def ckpt(rank: int, name: str, at: float, complete: bool = True) -> Manifest:
    return Manifest(
        project="proj", job_id="job1", node_rank=rank, name=name, files=[], size_bytes=0,
        created_at=at, complete=complete,
        incomplete_reason=None if complete else "rank 0's command exited with code 137",
    )  # fmt: skip


def test_no_checkpoint_resumes_from_the_start():
    point = resume_point(Listed(), "proj", "job1", ranks=2)
    assert (point.name, point.copies, point.newer) == (None, {}, {})


def test_the_latest_complete_checkpoint_of_every_rank_is_chosen():
    store = Listed(
        ckpt(0, "checkpoint-100", 10), ckpt(1, "checkpoint-100", 11),
        ckpt(0, "checkpoint-200", 20), ckpt(1, "checkpoint-200", 21),
    )  # fmt: skip
    point = resume_point(store, "proj", "job1", ranks=2)
    assert point.name == "checkpoint-200"
    assert {r: (m.node_rank, m.name) for r, m in point.copies.items()} == {
        0: (0, "checkpoint-200"),
        1: (1, "checkpoint-200"),
    }  # each rank resumes from its own copy
    assert point.newer == {0: [], 1: []}


def test_an_incomplete_checkpoint_is_skipped_for_the_complete_one_before_it():
    """The writer died while saving checkpoint-200: the job resumes from checkpoint-100."""
    store = Listed(
        ckpt(0, "checkpoint-100", 10),
        ckpt(0, "checkpoint-200", 20, complete=False),
    )
    assert resume_point(store, "proj", "job1", ranks=1).name == "checkpoint-100"


def test_a_checkpoint_only_some_ranks_stored_is_set_aside_so_no_rank_runs_ahead():
    store = Listed(
        ckpt(0, "checkpoint-100", 10), ckpt(1, "checkpoint-100", 11),
        ckpt(0, "checkpoint-200", 20),  # rank 1 was lost before storing its copy
    )  # fmt: skip
    point = resume_point(store, "proj", "job1", ranks=2)
    assert point.name == "checkpoint-100"
    assert point.newer == {0: ["checkpoint-200"], 1: []}


def test_ranks_that_never_write_get_the_lowest_writers_copy():
    """Rank 0 writes for all (a common torch.distributed habit): every rank restores it."""
    point = resume_point(Listed(ckpt(0, "checkpoint-300", 30)), "proj", "job1", ranks=3)
    assert point.name == "checkpoint-300"
    assert [(r, m.node_rank) for r, m in sorted(point.copies.items())] == [(0, 0), (1, 0), (2, 0)]
