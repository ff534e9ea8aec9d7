"""A command's output cut into lines and progress states (node/output_splitter.py); no Ray."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.node.output_splitter import MAX_LINE_CHARS, OutputSplitter, Piece
from orchestrator.node.secrets import SecretMasker

SECRET = "hf_tok_5be07c1d9a"


def splitter(secrets: tuple[str, ...] = ()) -> OutputSplitter:
    return OutputSplitter(SecretMasker(list(secrets)))


def tqdm_bar(total: int, per_step_s: float, start: float = 0.0) -> list[tuple[float, bytes]]:
    """What tqdm writes without a terminal: each state after a `\\r`, a newline at the end."""
    writes = [(start, b"\rtraining:   0%%|          | 0/%d" % total)]
    for step in range(1, total + 1):
        writes.append((start + step * per_step_s, b"\rtraining: %d/%d it" % (step, total)))
    writes.append((start + total * per_step_s, b"\n"))
    return writes


def run(s: OutputSplitter, writes: list[tuple[float, bytes]], tick_every: float = 0.1):
    """Feed the writes at their times, ticking in between as the agent's loop does."""
    pieces: list[tuple[float, Piece]] = []
    now = 0.0
    for at, data in writes:
        while now + tick_every < at:
            now += tick_every
            pieces += [(now, p) for p in s.tick(now)]
        now = at
        pieces += [(now, p) for p in s.feed(data, now)]
    pieces += [(now, p) for p in s.close()]
    return pieces


def test_a_bar_is_forwarded_while_it_runs_at_most_once_a_second_and_its_end_kept():
    pieces = run(splitter(), tqdm_bar(300, 0.05))  # 300 updates over 15 s
    progress = [(at, p.text) for at, p in pieces if p.progress]
    lines = [p.text for _, p in pieces if not p.progress]
    assert lines == ["training: 300/300 it"]  # the final state, a line of its own, last
    assert 12 <= len(progress) <= 17, progress  # ~one a second, not 300
    assert progress[0][0] < 1.0  # the first state at once
    assert all(b - a >= 0.99 for (a, _), (b, _) in itertools.pairwise(progress))
    # Each forwarded state is the latest complete one at that moment: tqdm writes `\r<state>`,
    # so the write at step k completes step k - 1 (a state left open shows after PARTIAL_AFTER_S).
    assert all(t == f"training: {round(at / 0.05) - 1}/300 it" for at, t in progress[1:]), progress
    assert pieces[-1][1] == Piece("training: 300/300 it")


def test_lines_around_a_bar_keep_their_order():
    writes = [(0.0, b"epoch 1\n"), *tqdm_bar(20, 0.1, start=0.1), (2.5, b"loss 0.25\n")]
    texts = [(p.progress, p.text) for _, p in run(splitter(), writes)]
    assert texts[0] == (False, "epoch 1")
    assert texts[-2:] == [(False, "training: 20/20 it"), (False, "loss 0.25")]
    assert all(progress for progress, _ in texts[1:-2])


def test_a_bar_ended_by_a_return_then_a_newline_keeps_its_last_state_as_the_line():
    writes = [(0.0, b"\rstep 1/3"), (0.2, b"\rstep 2/3"), (0.4, b"\rstep 3/3\r"), (0.6, b"\n")]
    lines = [p.text for _, p in run(splitter(), writes) if not p.progress]
    assert lines == ["step 3/3"]
    # ... and output that ends in the middle of a bar keeps its last state too.
    lines = [p.text for _, p in run(splitter(), writes[:3]) if not p.progress]
    assert lines == ["step 3/3"]


def test_text_without_an_ending_is_shown_after_a_second_then_as_its_line():
    writes = [(0.0, b"loading the model..."), (3.0, b" done\n")]
    pieces = run(splitter(), writes)
    assert [(round(at), p) for at, p in pieces] == [
        (1, Piece("loading the model...", progress=True)),
        (3, Piece("loading the model... done")),
    ]


def test_crlf_split_across_reads_is_one_line_ending():
    writes = [(0.0, b"first\r"), (0.01, b"\nsecond\r\n")]
    assert [p for _, p in run(splitter(), writes)] == [Piece("first"), Piece("second")]


def test_a_bar_cleared_to_print_a_line_loses_nothing():
    """tqdm.write: the bar is blanked with spaces, the message printed, the bar drawn again."""
    writes = [(0.0, b"\r 5/10"), (0.5, b"\r" + b" " * 20 + b"\r"), (0.5, b"checkpoint saved\n"),
              (0.6, b"\r 6/10"), (0.7, b"\r10/10\n")]  # fmt: skip
    pieces = [p for _, p in run(splitter(), writes)]
    assert [p.text for p in pieces if not p.progress] == ["checkpoint saved", "10/10"]
    assert Piece(" 5/10", progress=True) in pieces
    assert not any(p.text.strip() == "" for p in pieces)


def test_a_huge_line_is_cut_into_chunks_and_every_byte_arrives():
    s = splitter()
    blob = bytes(range(97, 123)) * 40_000  # ~1 MB of letters, no newline
    pieces = []
    for i in range(0, len(blob), 65536):
        pieces += s.feed(blob[i : i + 65536], 0.0)
        assert len(s._text) <= MAX_LINE_CHARS  # what is held stays bounded
    pieces += s.close()
    assert all(not p.progress and len(p.text) <= MAX_LINE_CHARS for p in pieces)
    assert "".join(p.text for p in pieces) == blob.decode()


def test_a_secret_is_masked_in_progress_states_and_where_a_chunk_is_cut():
    s = splitter((SECRET,))
    pieces = s.feed(f"\rtoken {SECRET} 1/2\r".encode(), 0.0) + s.tick(0.1)
    assert pieces == [Piece("token ***** 1/2", progress=True)]
    # A secret across the cut: the cut moves to its start, and it is masked whole.
    filler = "x" * (MAX_LINE_CHARS - 5)
    data = (filler + SECRET + "y" * 100).encode()
    pieces = s.feed(data[: MAX_LINE_CHARS + 2], 1.0) + s.feed(data[MAX_LINE_CHARS + 2 :], 1.0)
    pieces += s.close()
    assert len(pieces) == 2  # cut once, before the secret
    assert "".join(p.text for p in pieces) == filler + "*****" + "y" * 100
    assert all(SECRET[:6] not in p.text for p in pieces)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_character_split_between_reads_is_decoded_whole(cut):
    data = "température 5/10\n".encode()
    s = splitter()
    pieces = s.feed(data[: 4 + cut], 0.0) + s.feed(data[4 + cut :], 0.0)
    assert pieces == [Piece("température 5/10")]
