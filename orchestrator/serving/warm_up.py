"""The warm-up request that makes a replica ready: one greedy token of a short prompt, in time.

An engine that loads can still be unable to generate (vLLM's CPU build starts for a head size
below 32, then dies at its first request; a config whose attention cannot run), so a replica
answers one request before Serve calls it ready. A warm-up that hangs (an engine stuck, not
dead) fails the replica's start after WARM_UP_TIMEOUT_S instead of leaving it starting for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

WARM_UP_PROMPT = "Hello"
# One token after the model is loaded: seconds even for a large model on CPU.
WARM_UP_TIMEOUT_S = 300.0


def timed_out(timeout_s: float) -> TimeoutError:
    return TimeoutError(f"no answer within {timeout_s:g} s")


def within(timeout_s: float, call: Callable[[], object]) -> None:
    """`call()` in a thread of its own, raising what it raises, or a TimeoutError once it has
    run `timeout_s` (a forward pass cannot be interrupted: the thread ends with the replica)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="warm-up", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise timed_out(timeout_s)
    if failed:
        raise failed[0]
