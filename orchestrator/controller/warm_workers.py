"""Worker processes started ahead for the next job's node agents (the controller host only).

Ray starts a worker process for every actor: an interpreter, `import ray`, a connection,
0.6-0.7 s on a 2-core machine, and each job's node agent is a new actor, so every job pays it
between DEPLOYING and RUNNING. The raylet starts idle workers of a Ray job ahead when asked
(its `PrestartWorkers` call, ray_private.prestart_workers), and the job's next actor takes one
at once (its `__init__` ran 0.01 s after it was asked for, against 0.4-0.6 s cold). Ray ends a
worker whose Ray job has ended, so this is worth doing only while the host's Ray job lives:
the host's resident driver (host.py, `--resident`) turns it on, and the host asks only while
the GCS says that job is not dead.

When a job's commands have started, as many workers again as its actors took are asked for on
their nodes, kept `KEEP_S`: a queue of jobs finds one ready at each admission. Workers nobody
takes end after that (Ray's idle-worker rule), so what is wasted is one worker start per job
with no successor.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback

KEEP_S = 60
LIVE_CHECK_S = 5.0  # how long the GCS's answer that the host's Ray job lives is trusted


class WarmWorkers:
    """Asks the raylets of the host's nodes for workers of the host's Ray job."""

    def __init__(self, job_id: str, runtime_env: str) -> None:
        self.job_id, self.runtime_env = job_id, runtime_env
        self._lock = threading.Lock()
        self._live_at = -LIVE_CHECK_S
        self._live = False

    def after_start(self, raylets: list[str]) -> None:
        """A job's actors were placed on the nodes of these raylets (host:port, one entry
        each): a worker each, again."""
        if not raylets or not self._job_lives():
            return
        from orchestrator import ray_private

        for raylet, count in collections.Counter(raylets).items():
            try:
                ray_private.prestart_workers(raylet, self.job_id, self.runtime_env, count, KEEP_S)
            except Exception:  # a node gone or a raylet busy: that job's agent starts cold
                traceback.print_exc()

    def _job_lives(self) -> bool:
        with self._lock:
            if time.monotonic() - self._live_at >= LIVE_CHECK_S:
                from orchestrator import ray_private

                try:
                    jobs = ray_private.driver_jobs()
                    self._live = any(j.get("JobID") == self.job_id and not j.get("IsDead")
                                     for j in jobs)  # fmt: skip
                except Exception:
                    self._live = False
                self._live_at = time.monotonic()
            return self._live


_current: WarmWorkers | None = None


def turn_on() -> None:
    """Called in the host's process when its Ray job's driver stays (host.py, `--resident`)."""
    global _current
    import ray

    context = ray.get_runtime_context()
    _current = WarmWorkers(context.get_job_id(), context.get_runtime_env_string())


def is_on() -> bool:
    return _current is not None


def after_start(raylets: list[str]) -> None:
    """Called once a job's commands started; nothing unless this is a warm host."""
    if _current is not None:
        _current.after_start(raylets)
