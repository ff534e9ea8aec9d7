"""One root's queue entries in memory, each change written to its storage root first
(`QueueLedger`): what a call was answered is what a restarted service reads back, so an
admitted job is never admitted twice and a queued one keeps its place."""

from __future__ import annotations

from typing import Any

from orchestrator.storage.queue_store import QueueEntry, QueueStore


class QueueLedger:
    """The entries of one storage root, rebuilt from it at start, oldest push first."""

    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self._entries = {e.job_id: e for e in store.entries()}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._entries

    def __getitem__(self, job_id: str) -> QueueEntry:
        return self._entries[job_id]

    def get(self, job_id: str) -> QueueEntry | None:
        return self._entries.get(job_id)

    def all(self) -> list[QueueEntry]:
        return list(self._entries.values())

    def put(self, entry: QueueEntry) -> None:
        self.store.put(entry)  # durable first: a restart must find what was answered
        self._entries[entry.job_id] = entry

    def update(self, entry: QueueEntry, **changes: Any) -> None:
        self.put(entry.model_copy(update=changes))

    def remove(self, job_id: str) -> bool:
        """Whether it was there."""
        if self._entries.pop(job_id, None) is None:
            return False
        self.store.remove(job_id)
        return True
