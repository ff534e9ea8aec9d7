"""What a rank's checkpoint uploader saw of its rank writing checkpoints (`RankWrites`): the
evidence that tells a rank that never writes (rank 0 saves for every rank) from one lost before
its first save, for the resume point of a retried attempt (controller/resume_point.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class QuietSpell:
    """A stretch in which the uploader watched the rank's checkpoint directory while the rank's
    commands ran, and found nothing of the job's there (epoch seconds, the rank's clock)."""

    since: float  # the watch began: the uploader's start, or the attempt's
    until: float  # the last scan that found nothing, no later than the commands' end


@dataclass(frozen=True)
class RankWrites:
    """The first entry of the job's the uploader found in the rank's directory, and the quiet
    spells before it (one per watch: the uploader's start, each attempt)."""

    rank: int
    wrote: str | None = None  # a file, a hidden, temporary or empty directory, a checkpoint
    wrote_at: float | None = None
    quiet: tuple[QuietSpell, ...] = field(default_factory=tuple)

    def merged(self, newer: RankWrites) -> RankWrites:
        """Both reports in one; a spell `newer` reports again (the same `since`) is its."""
        spells = {s.since: s for s in self.quiet} | {s.since: s for s in newer.quiet}
        first = self if self.wrote is not None else newer
        return RankWrites(self.rank, first.wrote, first.wrote_at,
                          tuple(spells[k] for k in sorted(spells)))  # fmt: skip
