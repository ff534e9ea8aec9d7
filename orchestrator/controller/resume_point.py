"""Where a retried attempt resumes, from what the storage root holds: the job's manifests and
what each rank's uploader saw of its rank writing (`RankWrites`). Pure: tested without Ray in
tests/test_resume_point.py; docs/architecture.md, "Put every rank at the resume point".

A rank resumes from its own copy of a checkpoint. It gets another rank's copy only where the
job's checkpoints are known to be shared: one rank writes them and every other rank is known
not to, or the ranks' copies of a name are the same bytes. Otherwise a rank that stored none may
have had state of its own that was lost with it (a per-rank or sharded save), so the job
resumes from the newest checkpoint every rank that may write stored, which is the start when
one of them stored none.

A rank is known not to write when its uploader watched its checkpoint directory stay empty
(no file, not even a hidden or temporary directory, nothing of the job's come and gone) while
its commands ran, from before another rank stored a checkpoint until QUIET_MARGIN_S after.
Trainers whose ranks train in step (DDP, FSDP, DeepSpeed, torchrun) save at the same step, so a
rank that saves its own would have begun by the time another rank's save of that step was
written and uploaded. A rank lost before then is not known either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.node.rank_writes import RankWrites
from orchestrator.storage.checkpoints import Manifest

# How long after another rank's checkpoint was stored a rank's directory must still be empty,
# its commands running, for the rank to count as one that does not write. The stored time is
# already past that rank's whole save and upload, and a spell ends at a listing of the directory
# as it then was, so this covers the nodes' clock skew and a save begun just after a barrier
# that follows another rank's write, with room to spare. Not more: a job whose rank 0 writes for
# all must keep its progress when another rank is lost soon after a checkpoint (the controller
# asks every POLL_EVERY_S, 1 s: a rank lost 2 s after one is known not to write).
QUIET_MARGIN_S = 0.5


@dataclass(frozen=True)
class Role:
    """Whether a rank writes checkpoints of its own, and what says so."""

    writes: bool | None  # None: nothing says either way
    why: str


@dataclass(frozen=True)
class ResumePoint:
    """Where a retried attempt starts, and which rule chose it (`why`, for the job's log)."""

    name: str | None  # None: from the start
    copies: dict[int, Manifest]  # rank -> the copy it resumes from: its own, or a shared one
    newer: dict[int, list[str]]  # rank -> its checkpoints newer than `name` (all, from the start)
    why: str
    # rank -> the files at the top restored beside `name`, a directory (DeepSpeed's `latest`
    # pointer, Ray Train's snapshot: what a trainer reads to find the directory)
    top: dict[int, Manifest] = field(default_factory=dict)
    # A Ray Train job's: rank -> the other nodes' parts of `name` put in beside its own, and
    # the commit resumed from (what Train's snapshot for the next attempt says)
    parts: dict[int, list[Manifest]] = field(default_factory=dict)
    commit: TrainCommit | None = None


@dataclass(frozen=True)
class TrainCommit:
    """One checkpoint Ray Train committed (every worker reported its round), as the job's
    stored rounds say: the nodes whose workers wrote a part of it, and the round's metrics."""

    name: str
    parts: tuple[int, ...]
    at: float
    index: int  # the round's place in its run (Train's report index)
    metrics: dict[str, Any] = field(default_factory=dict)


def train_resume_point(
    manifests: list[Manifest], commits: list[TrainCommit], ranks: int
) -> ResumePoint:
    """Where a Ray Train job's attempt n+1 resumes: the newest checkpoint Train committed whose
    every node's part is stored complete (whole), with every part put on every node. A
    directory Train never committed is never one (its round was not every worker's); one whose
    round was not stored (the driver's node lost first) is not known to be whole."""
    stored = {(m.node_rank, m.name): m for m in manifests if m.complete and not m.top_level}
    dirs = [m for m in manifests if not m.top_level]
    for commit in sorted(commits, key=lambda c: c.at, reverse=True):
        held = [stored.get((r, commit.name)) for r in commit.parts]
        if not commit.parts or None in held:
            continue
        whole = [m for m in held if m is not None]
        made = max(m.created_at for m in whole)
        newer = {r: sorted({m.name for m in dirs if m.node_rank == r and m.name != commit.name
                            and m.created_at > made}) for r in range(ranks)}  # fmt: skip
        copies = {m.node_rank: m for m in whole if m.node_rank < ranks}
        parts = {r: [m for m in whole if m.node_rank != r] for r in range(ranks)}
        nodes = ", ".join(map(str, commit.parts))
        why = (f"the newest checkpoint Ray Train committed whose every part is stored (node "
               f"rank(s) {nodes} wrote one), put whole on every node")  # fmt: skip
        return ResumePoint(commit.name, copies, newer, why, parts=parts, commit=commit)
    every = {r: sorted({m.name for m in dirs if m.node_rank == r}) for r in range(ranks)}
    why = ("no checkpoint Ray Train committed is stored whole" if commits
           else "Ray Train committed no checkpoint")  # fmt: skip
    return ResumePoint(None, {}, every, why)


def role(rank: int, manifests: list[Manifest], writes: RankWrites | None) -> Role:
    """Whether `rank` writes checkpoints: it stored one (complete or not), or its uploader saw
    it write; it does not, if its directory stayed empty while another rank stored one and
    QUIET_MARGIN_S after, its commands running."""
    own = [m for m in manifests if m.node_rank == rank]
    if own:
        return Role(True, f"it stored {own[0].name}")
    if writes is not None and writes.wrote is not None:
        return Role(True, f"it had written {writes.wrote} into its checkpoint directory")
    others = sorted((m for m in manifests if m.complete), key=lambda m: m.created_at)
    for spell in writes.quiet if writes is not None else []:
        for m in others:
            if spell.since <= m.created_at and m.created_at + QUIET_MARGIN_S <= spell.until:
                return Role(False, f"its checkpoint directory stayed empty, its commands running, "
                                   f"while rank {m.node_rank} stored {m.name} and "
                                   f"{spell.until - m.created_at:.1f} s after")  # fmt: skip
    return Role(None, f"it stored no checkpoint and was not seen running with an empty checkpoint "
                      f"directory {QUIET_MARGIN_S:g} s after another rank stored one")  # fmt: skip


def resume_point(
    manifests: list[Manifest], writes: dict[int, RankWrites], ranks: int
) -> ResumePoint:
    """The checkpoint attempt n+1 resumes from, each rank's copy of it, and what each rank
    sets aside; `writes`: each rank's RankWrites, `ranks`: the group's size. Where the job has
    directory checkpoints, the point is one of them and the files at the top (a top-level
    manifest) come with it, as each rank has them; they are the point alone only in a job
    that saves nothing else (nanoGPT's `ckpt.pt`)."""
    every = sorted(set(range(ranks)) | {m.node_rank for m in manifests})
    roles = {r: role(r, manifests, writes.get(r)) for r in every}
    dirs = [m for m in manifests if not m.top_level]
    if not any(m.complete for m in dirs):
        return _point(manifests, roles, every, ranks)
    point = _point(dirs, roles, every, ranks)
    tops = {m.node_rank: m for m in manifests if m.top_level and m.complete}
    if not tops:
        return point
    if point.name is None:
        newer = dict(point.newer)
        for r, m in tops.items():
            newer[r] = [*newer.get(r, []), m.name]
        return replace(point, newer=newer)
    # A rank given another rank's copy (shared checkpoints) gets that rank's files too.
    top = {r: tops[c.node_rank] for r, c in point.copies.items() if c.node_rank in tops}
    with_top = f"; with the files at the top ({next(iter(tops.values())).name})" if top else ""
    return replace(point, top=top, why=point.why + with_top)


def _point(
    manifests: list[Manifest], roles: dict[int, Role], every: list[int], ranks: int
) -> ResumePoint:
    complete: dict[int, dict[str, Manifest]] = {}
    for m in sorted(manifests, key=lambda m: (m.created_at, m.node_rank)):
        if m.complete:
            complete.setdefault(m.node_rank, {})[m.name] = m
    writers = [r for r in every if roles[r].writes]
    unknown = [r for r in every if roles[r].writes is None]
    silent = [r for r in every if roles[r].writes is False]
    from_start = {r: sorted(names) for r, names in complete.items()}
    if not complete:
        return ResumePoint(None, {}, from_start, "no rank has stored a complete checkpoint")
    same = _same_bytes(complete)
    if len(writers) == 1 and not unknown:
        holders, shared = writers, True
        how = f"rank {writers[0]} writes the checkpoints for every rank" + "".join(
            f"; rank {r} does not: {roles[r].why}" for r in silent
        )
        if ranks == 1:
            how = "the newest checkpoint of the job's only rank"
    elif same is not None:
        holders, shared = sorted(complete), True
        how = f"the ranks' copies of {same} are the same bytes, so their checkpoints are shared"
    else:
        holders, shared = sorted(writers + unknown), False
        how = "the newest checkpoint every rank that may write stored complete, each its own copy"
        lacking = next((r for r in holders if r not in complete), None)
        if lacking is not None:
            why = (f"rank {lacking} has no complete checkpoint ({roles[lacking].why}), and "
                   "another rank's cannot stand in for its own state: the job's checkpoints "
                   "are not known to be shared (one rank writing them all, or the same bytes "
                   "on every rank)")  # fmt: skip
            return ResumePoint(None, {}, from_start, why)
    common = set.intersection(*(set(complete[r]) for r in holders))
    if not common:
        why = f"ranks {', '.join(map(str, holders))} have no complete checkpoint in common"
        return ResumePoint(None, {}, from_start, why)
    name = max(common, key=lambda n: max(complete[r][n].created_at for r in holders))
    copies = {r: complete[r][name] for r in holders if r < ranks}
    given = [r for r in range(ranks) if r not in copies]
    if shared:
        copies |= {r: complete[holders[0]][name] for r in given}
        if given:
            how += f"; rank(s) {', '.join(map(str, given))} get rank {holders[0]}'s copy"
    elif given:
        how += f"; rank(s) {', '.join(map(str, given))} write none and get none"
    newer = {
        r: sorted(n for n, m in names.items() if m.created_at > names[name].created_at)
        for r, names in complete.items()
    }
    return ResumePoint(name, copies, newer, how)


def _same_bytes(complete: dict[int, dict[str, Manifest]]) -> str | None:
    """A name two or more ranks stored complete, if every such name is the same files with the
    same sha256s on each (replicated state); None if none is, or one differs."""
    copies: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    held: dict[str, int] = {}
    for names in complete.values():
        for name, m in names.items():
            copies.setdefault(name, set()).add(tuple(sorted((f.path, f.sha256) for f in m.files)))
            held[name] = held.get(name, 0) + 1
    shared = sorted(n for n in copies if held[n] > 1)
    if not shared or any(len(copies[n]) > 1 for n in shared):
        return None
    return shared[0]
