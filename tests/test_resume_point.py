"""Where a retried attempt resumes: the newest checkpoint every rank can resume from, and a rank
given another rank's copy only where the job's checkpoints are known to be shared.

`resume_point` is pure: it is given the job's manifests as the store lists them and each rank's
`RankWrites` (what its uploader saw it write) as the controller gathered them. Two kinds of job
are played through: rank 0 writes for every rank (the DDP recipe, Hugging Face on one node),
and every rank writes its own state (per-rank RNG, sharded optimizers), with the rank that lacks
a checkpoint lost before its first save and during it. Times are epoch seconds on one clock.
"""

from __future__ import annotations

from orchestrator.controller.resume_point import QUIET_MARGIN_S, resume_point
from orchestrator.node.rank_writes import QuietSpell, RankWrites
from orchestrator.storage.checkpoints import Manifest, ManifestFile


def ckpt(rank: int, name: str, at: float, complete: bool = True, same: bool = False) -> Manifest:
    """Rank `rank`'s copy of `name`, stored at `at`: its own bytes, or with `same` the bytes
    every rank's copy of that name has (replicated state)."""
    digest = f"{name}" if same else f"rank-{rank}-{name}"
    return Manifest(
        project="proj", job_id="job1", node_rank=rank, name=name,
        files=[ManifestFile(path="state.pt", size=1, sha256=digest)], size_bytes=1,
        created_at=at, complete=complete,
        incomplete_reason=None if complete else f"rank {rank}'s command exited with code 137",
    )  # fmt: skip


def quiet(rank: int, since: float, until: float) -> RankWrites:
    """Its uploader found nothing of the job's in its directory from `since` to `until`, its
    commands running."""
    return RankWrites(rank=rank, quiet=(QuietSpell(since, until),))


def wrote(rank: int, entry: str, at: float, since: float = 0) -> RankWrites:
    """Quiet from `since` until its uploader saw `entry` appear at `at`."""
    return RankWrites(rank=rank, wrote=entry, wrote_at=at,
                      quiet=(QuietSpell(since, at - 0.1),))  # fmt: skip


def copies(point) -> dict[int, str]:
    return {r: f"rank-{m.node_rank}/{m.name}" for r, m in sorted(point.copies.items())}


def test_no_checkpoint_resumes_from_the_start():
    point = resume_point([], {}, ranks=2)
    assert (point.name, point.copies, point.newer) == (None, {}, {})
    assert point.why == "no rank has stored a complete checkpoint"


def test_the_latest_complete_checkpoint_of_every_rank_is_chosen():
    manifests = [
        ckpt(0, "checkpoint-100", 10), ckpt(1, "checkpoint-100", 11),
        ckpt(0, "checkpoint-200", 20), ckpt(1, "checkpoint-200", 21),
    ]  # fmt: skip
    point = resume_point(manifests, {}, ranks=2)
    assert point.name == "checkpoint-200"
    assert copies(point) == {0: "rank-0/checkpoint-200", 1: "rank-1/checkpoint-200"}
    assert point.newer == {0: [], 1: []}
    assert point.why == (
        "the newest checkpoint every rank that may write stored complete, each its own copy"
    )


def test_an_incomplete_checkpoint_is_skipped_for_the_complete_one_before_it():
    """The writer died while saving checkpoint-200: the job resumes from checkpoint-100."""
    manifests = [ckpt(0, "checkpoint-100", 10), ckpt(0, "checkpoint-200", 20, complete=False)]
    assert resume_point(manifests, {}, ranks=1).name == "checkpoint-100"


def test_a_checkpoint_only_some_ranks_stored_is_set_aside_so_no_rank_runs_ahead():
    manifests = [
        ckpt(0, "checkpoint-100", 10), ckpt(1, "checkpoint-100", 11),
        ckpt(0, "checkpoint-200", 20),  # rank 1 was lost before storing its copy
    ]  # fmt: skip
    point = resume_point(manifests, {}, ranks=2)
    assert point.name == "checkpoint-100"
    assert point.newer == {0: ["checkpoint-200"], 1: []}


# --- rank 0 writes for every rank --------------------------------------------------------------


def test_a_rank_seen_not_writing_gets_the_writers_copy_when_its_node_is_lost():
    """Rank 1 never writes; its node crashed after rank 0 stored two checkpoints. Its uploader
    had found its directory empty well after rank 0 stored checkpoint-5: it gets rank 0's copy
    of the newest, so the user's progress is kept."""
    manifests = [ckpt(0, "checkpoint-5", 50), ckpt(0, "checkpoint-10", 100)]
    point = resume_point(manifests, {1: quiet(1, since=1, until=101)}, ranks=2)
    assert point.name == "checkpoint-10"
    assert copies(point) == {0: "rank-0/checkpoint-10", 1: "rank-0/checkpoint-10"}
    assert point.newer == {0: []}
    assert point.why.startswith("rank 0 writes the checkpoints for every rank; rank 1 does not: "
                                "its checkpoint directory stayed empty, its commands running, "
                                "while rank 0 stored checkpoint-5 and 51.0 s after")  # fmt: skip
    assert point.why.endswith("; rank(s) 1 get rank 0's copy")


def test_the_writers_own_copy_when_the_writers_node_is_lost():
    """Rank 0's node is lost after checkpoint-10; rank 1 lived on, its directory empty."""
    manifests = [ckpt(0, "checkpoint-5", 50), ckpt(0, "checkpoint-10", 100)]
    writes = {1: quiet(1, since=1, until=103)}  # until its commands failed after rank 0's loss
    point = resume_point(manifests, writes, ranks=2)
    assert copies(point) == {0: "rank-0/checkpoint-10", 1: "rank-0/checkpoint-10"}


def test_a_non_writer_lost_too_soon_after_the_first_save_is_not_known_not_to_write():
    """Rank 1's last word came within QUIET_MARGIN_S of rank 0's only checkpoint: it may be a
    rank that saves its own and had not begun yet. Every rank starts again, and rank 0's
    checkpoint is set aside so that it does not run ahead of rank 1."""
    manifests = [ckpt(0, "checkpoint-5", 50)]
    point = resume_point(manifests, {1: quiet(1, 1, 50 + QUIET_MARGIN_S / 2)}, ranks=2)
    assert (point.name, point.copies) == (None, {})
    assert point.newer == {0: ["checkpoint-5"]}
    assert point.why.startswith(
        "rank 1 has no complete checkpoint (it stored no checkpoint "
        "and was not seen running with an empty checkpoint directory"
    )
    assert "not known to be shared" in point.why


def test_a_non_writer_lost_before_the_first_save_is_not_known_not_to_write():
    """Rank 1's node crashed at step 2; rank 0 stored checkpoint-5 and -10 before Ray declared
    the node dead. Rank 1 may have been a rank that saves its own: every rank starts again."""
    manifests = [ckpt(0, "checkpoint-5", 50), ckpt(0, "checkpoint-10", 100)]
    point = resume_point(manifests, {1: quiet(1, since=1, until=20)}, ranks=2)
    assert (point.name, point.copies) == (None, {})
    assert point.newer == {0: ["checkpoint-10", "checkpoint-5"]}
    assert point.why.startswith("rank 1 has no complete checkpoint (it stored no checkpoint")


def test_an_empty_directory_before_the_attempt_says_nothing_of_a_later_checkpoint():
    """Rank 1's directory was empty for all of attempt 0, before checkpoint-5 existed; in
    attempt 1, which stored it, its uploader never reported: not known."""
    manifests = [ckpt(0, "checkpoint-5", 50)]
    writes = {1: RankWrites(rank=1, quiet=(QuietSpell(1, 30), QuietSpell(40, 40.5)))}  # fmt: skip
    assert resume_point(manifests, writes, ranks=2).name is None


def test_the_only_writer_lost_before_its_first_save_starts_everyone_again():
    point = resume_point([], {1: quiet(1, 1, 100)}, ranks=2)
    assert (point.name, point.why) == (None, "no rank has stored a complete checkpoint")


def test_the_only_writer_lost_during_its_first_save_starts_everyone_again():
    hidden = {0: wrote(0, ".checkpoint-5", at=49), 1: quiet(1, 1, 100)}
    assert resume_point([], hidden, ranks=2).name is None
    stored_incomplete = [ckpt(0, "checkpoint-5", 50, complete=False)]
    point = resume_point(stored_incomplete, {1: quiet(1, 1, 100)}, ranks=2)
    assert (point.name, point.why) == (None, "no rank has stored a complete checkpoint")


def test_the_only_writer_lost_during_a_later_save_resumes_everyone_from_the_one_before():
    manifests = [ckpt(0, "checkpoint-5", 50), ckpt(0, "checkpoint-10", 100, complete=False)]
    point = resume_point(manifests, {1: quiet(1, 1, 100)}, ranks=2)
    assert copies(point) == {0: "rank-0/checkpoint-5", 1: "rank-0/checkpoint-5"}


def test_three_ranks_with_one_writer_need_every_other_known_not_to_write():
    manifests = [ckpt(0, "checkpoint-5", 50)]
    both = {1: quiet(1, 1, 60), 2: quiet(2, 1, 60)}
    assert copies(resume_point(manifests, both, ranks=3)) == {
        r: "rank-0/checkpoint-5" for r in range(3)
    }
    one = {1: quiet(1, 1, 60)}  # rank 2 was lost before it could be known
    point = resume_point(manifests, one, ranks=3)
    assert point.name is None and point.why.startswith("rank 2 has no complete checkpoint")


# --- every rank writes its own -----------------------------------------------------------------


def test_a_rank_lost_before_its_first_save_is_never_given_another_ranks_state():
    """Issue 58: rank 0's node crashed at step 2, before its first save; rank 1 went on and
    stored checkpoint-6, -12 and -17 before the node was declared dead. Rank 0 resumed from
    rank-1/checkpoint-17. Now every rank starts again, rank 1's checkpoints set aside."""
    manifests = [
        ckpt(1, "checkpoint-6", 60),
        ckpt(1, "checkpoint-12", 120),
        ckpt(1, "checkpoint-17", 170),
    ]
    writes = {0: quiet(0, since=1, until=20), 1: wrote(1, ".checkpoint-6", at=55)}
    point = resume_point(manifests, writes, ranks=2)
    assert (point.name, point.copies) == (None, {})
    assert point.newer == {1: ["checkpoint-12", "checkpoint-17", "checkpoint-6"]}
    assert point.why.startswith("rank 0 has no complete checkpoint (it stored no checkpoint")


def test_a_rank_lost_during_its_first_save_is_never_given_another_ranks_state():
    manifests = [ckpt(1, "checkpoint-6", 60), ckpt(1, "checkpoint-12", 120)]
    # Its uploader saw the hidden directory of its save being written...
    hidden = {0: wrote(0, ".checkpoint-6", at=59.5)}
    point = resume_point(manifests, hidden, ranks=2)
    assert point.name is None
    assert "(it had written .checkpoint-6 into its checkpoint directory)" in point.why
    # ...or was last asked just before the save began, as rank 1 stored its copy...
    late = {0: quiet(0, since=1, until=60 + QUIET_MARGIN_S / 2)}
    assert resume_point(manifests, late, ranks=2).name is None
    # ...or stored it INCOMPLETE (the node lived: its uploader's end of attempt stored it).
    cut = [*manifests, ckpt(0, "checkpoint-6", 61, complete=False)]
    point = resume_point(cut, {}, ranks=2)
    assert point.name is None and point.why.startswith("rank 0 has no complete checkpoint "
                                                       "(it stored checkpoint-6)")  # fmt: skip


def test_a_rank_lost_during_a_later_save_resumes_every_rank_from_its_own_earlier_copy():
    manifests = [
        ckpt(0, "checkpoint-6", 60), ckpt(1, "checkpoint-6", 60.2),
        ckpt(1, "checkpoint-12", 120), ckpt(0, "checkpoint-12", 121, complete=False),
    ]  # fmt: skip
    point = resume_point(manifests, {}, ranks=2)
    assert copies(point) == {0: "rank-0/checkpoint-6", 1: "rank-1/checkpoint-6"}
    assert point.newer == {0: [], 1: ["checkpoint-12"]}


def test_a_rank_that_wrote_after_an_empty_spell_is_a_writer():
    """Its directory was empty well after rank 1 stored checkpoint-6, then it wrote (a rank
    that saves late): what it wrote outweighs the empty spell."""
    manifests = [ckpt(1, "checkpoint-6", 60)]
    writes = {0: RankWrites(rank=0, wrote=".checkpoint-6", wrote_at=70,
                            quiet=(QuietSpell(1, 65),))}  # fmt: skip
    assert resume_point(manifests, writes, ranks=2).name is None


def test_replicated_copies_are_shared_by_their_bytes():
    """Every rank saves the same state (a replicated model): ranks 0 and 1 stored the same bytes,
    so rank 2, lost before its first save, may take rank 0's copy."""
    manifests = [ckpt(0, "checkpoint-6", 60, same=True), ckpt(1, "checkpoint-6", 60.1, same=True)]
    point = resume_point(manifests, {}, ranks=3)
    assert copies(point) == {0: "rank-0/checkpoint-6", 1: "rank-1/checkpoint-6",
                             2: "rank-0/checkpoint-6"}  # fmt: skip
    assert "the ranks' copies of checkpoint-6 are the same bytes" in point.why


def test_copies_that_differ_anywhere_are_not_shared():
    manifests = [
        ckpt(0, "checkpoint-6", 60, same=True), ckpt(1, "checkpoint-6", 60.1, same=True),
        ckpt(0, "checkpoint-12", 120), ckpt(1, "checkpoint-12", 120.1),  # each its own RNG state
    ]  # fmt: skip
    assert resume_point(manifests, {}, ranks=3).name is None


def test_a_rank_known_not_to_write_beside_ranks_with_their_own_state_gets_nothing():
    """Ranks 0 and 1 write their own state; rank 2 writes none. It is given no one's copy."""
    manifests = [ckpt(0, "checkpoint-6", 60), ckpt(1, "checkpoint-6", 60.1)]
    point = resume_point(manifests, {2: quiet(2, 1, 70)}, ranks=3)
    assert copies(point) == {0: "rank-0/checkpoint-6", 1: "rank-1/checkpoint-6"}
    assert "rank(s) 2 write none and get none" in point.why


def test_reports_merge_spell_by_spell_and_keep_the_first_write():
    first = RankWrites(rank=0, quiet=(QuietSpell(1, 5),))
    again = RankWrites(rank=0, quiet=(QuietSpell(1, 9), QuietSpell(20, 21)))
    merged = first.merged(again)
    assert [(s.since, s.until) for s in merged.quiet] == [(1, 9), (20, 21)]
    seen = merged.merged(RankWrites(rank=0, wrote=".tmp", wrote_at=30))
    assert (seen.wrote, seen.merged(RankWrites(rank=0, wrote="x", wrote_at=40)).wrote) == (
        ".tmp",
        ".tmp",
    )


def top(rank: int, at: float, same: bool = False) -> Manifest:
    """Rank `rank`'s files at the top of its checkpoint directory (DeepSpeed's `latest`)."""
    return ckpt(rank, "top-level", at, same=same).model_copy(update={"top_level": True})


def test_the_files_at_the_top_come_with_the_directory_resumed_from():
    """DeepSpeed saves `global_step<N>/` and then rewrites `latest` (the tag to load) at the top:
    the resume point is the newest directory, and `latest` comes back beside it, or the trainer
    finds no tag to load on a replacement node."""
    manifests = [
        ckpt(0, "global_step100", 10), top(0, 11),
        ckpt(0, "global_step200", 20), top(0, 21),
    ]  # fmt: skip
    point = resume_point(manifests, {1: quiet(1, 0, 30)}, ranks=2)
    assert point.name == "global_step200", point.why
    assert copies(point) == {0: "rank-0/global_step200", 1: "rank-0/global_step200"}
    assert {r: f"rank-{m.node_rank}/{m.name}" for r, m in point.top.items()} == {
        0: "rank-0/top-level",
        1: "rank-0/top-level",
    }
    assert point.newer == {0: []}, "the files at the top are kept, not set aside"
    assert point.why.endswith("; with the files at the top (top-level)")


def test_the_files_at_the_top_alone_are_the_point_of_a_job_that_saves_nothing_else():
    point = resume_point([top(0, 10)], {1: quiet(1, 0, 30)}, ranks=2)
    assert point.name == "top-level" and point.top == {}
    assert copies(point) == {0: "rank-0/top-level", 1: "rank-0/top-level"}


def test_starting_again_sets_the_files_at_the_top_aside_too():
    """Per-rank state with rank 1 lost before its first save: nothing is resumed, so no rank
    keeps a `latest` that names a directory it no longer has."""
    manifests = [ckpt(0, "global_step100", 10), top(0, 11)]
    point = resume_point(manifests, {1: wrote(1, ".tmp-global_step100", 9.5)}, ranks=2)
    assert point.name is None, point.why
    assert point.newer == {0: ["global_step100", "top-level"]}
