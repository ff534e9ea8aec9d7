"""Directories renamed into (or created in) a directory, told by Linux inotify the moment it
happens.

A rename is how careful writers commit a checkpoint, so the uploader starts on it at once. A
directory created and deleted between two of the uploader's scans (a trainer rotating checkpoints
faster than that) is still known to have been there. Where inotify is missing (not Linux) or its
queue overflowed, nothing is reported: the uploader's settle time and scans decide instead.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

try:
    from inotify_simple import INotify, flags
except (ImportError, OSError):  # not Linux
    INotify = None  # type: ignore[assignment,misc]


class RenameWatch:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inotify: Any = None
        self._appeared: set[str] = set()
        self._open()

    def _open(self) -> None:
        if INotify is None or not self.directory.is_dir():
            return
        watch = INotify(nonblocking=True)
        try:
            mask = flags.MOVED_TO | flags.MOVED_FROM | flags.CREATE | flags.ONLYDIR
            watch.add_watch(self.directory, mask)
        except OSError:
            watch.close()
            return
        self._inotify = watch

    def renamed(self) -> set[str]:
        """Names of directories moved in since the last call."""
        if self._inotify is None:
            self._open()  # the directory may exist now, or the watch was lost
            return set()
        names: set[str] = set()
        for event in self._inotify.read(timeout=0):
            if event.mask & (flags.IGNORED | flags.Q_OVERFLOW):
                self.close()  # the directory went away, or events were lost: start again
                return names
            if not event.mask & flags.ISDIR:
                continue
            if event.mask & flags.MOVED_FROM:  # renamed away (staged, then committed): not lost
                self._appeared.discard(event.name)
                continue
            self._appeared.add(event.name)
            if event.mask & flags.MOVED_TO:
                names.add(event.name)
        return names

    def appeared(self) -> set[str]:
        """Names of directories created or moved in since the last call (read by `renamed`)."""
        names, self._appeared = self._appeared, set()
        return names

    def close(self) -> None:
        if self._inotify is not None:
            with contextlib.suppress(OSError):
                self._inotify.close()
            self._inotify = None
