"""A command's output cut into what a log keeps: lines, and the latest state of a progress bar.

A progress bar drawn without a terminal (tqdm, Hugging Face Trainer, Accelerate, Lightning) is one
line rewritten with carriage returns (`\\rtrain: 153/300`) and ended by a newline only when the bar
is done. Waiting for that newline hides an hour-long epoch; keeping every rewrite stores thousands
of lines. So the splitter turns bytes as they arrive into pieces:

- a **line** for text ended by `\\n` (or `\\r\\n`), always kept, in order; so is a bar's final
  state (the text before its newline, or the last state when the newline comes right after a
  `\\r`);
- a **progress** piece for the latest state of a line rewritten by `\\r`, at most one every
  `UPDATE_EVERY_S` (the latest state at that moment; the first after a quiet spell at once); a
  state not yet forwarded when its line ends is dropped (the line is newer), and one pending
  when a long line is cut goes before the cut, so order holds;
- a **progress** piece for text with no ending yet that has waited `PARTIAL_AFTER_S`
  (`print("loading...", end="")`), shown until its line ends;
- text that goes on for `MAX_LINE_CHARS` (256 KiB) without an ending is cut there into a line
  (a binary dump or minified JSON cannot grow memory without bound).

Secrets are masked in every piece. A cut never splits a secret: it moves to the secret's start.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from orchestrator.node.secrets import SecretMasker

UPDATE_EVERY_S = 1.0  # progress states forwarded per rewritten line: at most one per second
PARTIAL_AFTER_S = 1.0  # text without an ending is shown once it has waited this long
# A longer run of text without an ending is cut into lines this long: far above any log line
# (a JSON record of a thousand checksums is ~100 KiB), so only dumps are cut.
MAX_LINE_CHARS = 256 * 1024
CR_WAIT_S = 0.05  # a `\r` with nothing after it this long is not the start of `\r\n`

_ENDINGS = re.compile("\r\n|\r|\n")


@dataclass(frozen=True)
class Piece:
    text: str
    progress: bool = False  # the latest state of a line still being rewritten


class OutputSplitter:
    """Fed a command's raw output as it is read; gives the pieces to forward. Not thread-safe:
    one reader feeds it and calls `tick` between reads."""

    def __init__(
        self,
        mask: SecretMasker,
        max_chars: int = MAX_LINE_CHARS,
        update_every_s: float = UPDATE_EVERY_S,
        partial_after_s: float = PARTIAL_AFTER_S,
    ) -> None:
        self._mask = mask
        self._max = max(max_chars, 2 * max((len(p) for p in mask.pieces), default=0) + 1)
        self._update_every, self._partial_after = update_every_s, partial_after_s
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # the line under construction: text since the last ending
        self._text_since: float | None = None  # when it started waiting for an ending
        self._cr = False  # the last ending read was `\r`: a `\n` may follow
        self._cr_at = 0.0
        self._update: str | None = None  # the latest `\r`-ended state, not yet forwarded
        self._last_state: str | None = None  # the latest state, forwarded or not
        self._forwarded_at = -1e18  # when a progress piece was last forwarded
        self._shown_partial: str | None = None

    def feed(self, data: bytes, now: float) -> list[Piece]:
        pieces: list[Piece] = []
        text = self._decoder.decode(data)
        start = 0
        for ending in _ENDINGS.finditer(text):
            self._text_before(text[start : ending.start()], now, pieces)
            start = ending.end()
            if ending.group() == "\r":
                if self._cr:  # `\r\r`: the state before the first one is complete
                    self._state(now, pieces)
                self._cr, self._cr_at = True, now
            else:
                self._cr = False
                self._newline(pieces)
        self._text_before(text[start:], now, pieces)
        return pieces + self.tick(now)

    def tick(self, now: float) -> list[Piece]:
        """Called between reads: the pending progress state once it is due, and text without an
        ending once it has waited long enough."""
        pieces: list[Piece] = []
        if self._cr and now - self._cr_at >= CR_WAIT_S:
            self._cr = False  # no `\n` came after the `\r`
            self._state(now, pieces)
        if self._update is not None and now - self._forwarded_at >= self._update_every:
            self._forward_update(now, pieces)
        waited = self._text_since is not None and now - self._text_since >= self._partial_after
        new = self._text.strip() and self._text != self._shown_partial
        if waited and new and now - self._forwarded_at >= self._update_every:
            self._shown_partial, self._forwarded_at = self._text, now
            pieces.append(Piece(self._mask(self._text), progress=True))
        return pieces

    def close(self) -> list[Piece]:
        """The output ended: what is left is the last line (a bar's last state included)."""
        pieces: list[Piece] = []
        self._append(self._decoder.decode(b"", final=True), 0.0, pieces)
        if self._cr:
            self._cr = False
            self._state(0.0, pieces)
        self._newline(pieces, final=True)
        return pieces

    # --- the line under construction -----------------------------------------------------------

    def _text_before(self, text: str, now: float, pieces: list[Piece]) -> None:
        """Text up to the next ending; after a `\\r` it begins a new state of the line."""
        if text and self._cr:
            self._cr = False
            self._state(now, pieces)
        self._append(text, now, pieces)

    def _append(self, text: str, now: float, pieces: list[Piece]) -> None:
        if not text:
            return
        if not self._text:
            self._text_since = now
        self._text += text
        while len(self._text) > self._max:
            cut = self._cut_at(self._max)
            head, self._text = self._text[:cut], self._text[cut:]
            self._text_since = now
            self._flush_update(pieces)
            pieces.append(Piece(self._mask(head)))

    def _cut_at(self, at: int) -> int:
        """`at`, or the start of a secret that would straddle it, or of what could be a secret
        whose rest has not been read yet (never 0: `_max` is over twice the longest secret)."""
        pattern = self._mask.pattern
        if pattern is None:
            return at
        for match in pattern.finditer(self._text, max(0, at - len(self._mask.pieces[0]))):
            if match.start() < at < match.end():
                return match.start()
        return min(at, len(self._text) - self._mask.open_end(self._text))

    def _state(self, now: float, pieces: list[Piece]) -> None:
        """The line under construction was ended by `\\r`: it is the bar's latest state."""
        text, self._text, self._text_since = self._text, "", None
        self._shown_partial = None
        if not text.strip():
            return  # an empty state, or a bar cleared with spaces before a line is printed
        self._update = self._last_state = text
        if now - self._forwarded_at >= self._update_every:
            self._forward_update(now, pieces)

    def _newline(self, pieces: list[Piece], final: bool = False) -> None:
        """A line ended: kept whole. Ended right after a `\\r`, it is the bar's last state. A
        state not yet forwarded is dropped: the line that ends it is newer."""
        text = self._text or self._last_state or ""
        self._text, self._text_since, self._shown_partial = "", None, None
        self._update = self._last_state = None
        if text or not final:
            pieces.append(Piece(self._mask(text)))

    def _flush_update(self, pieces: list[Piece]) -> None:
        """A state not yet forwarded goes before what follows it, so the log keeps the order."""
        if self._update is not None:
            pieces.append(Piece(self._mask(self._update), progress=True))
            self._update = None

    def _forward_update(self, now: float, pieces: list[Piece]) -> None:
        self._forwarded_at = now
        self._flush_update(pieces)
