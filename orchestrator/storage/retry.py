"""Storage errors that pass and errors that do not, and riding out the ones that pass.

Object stores have moments: a refused or reset connection, a timeout, 503 SlowDown, throttling, an
expired token being refreshed. Those are *transient*: a call is tried again with backoff and
jitter for as long as an outage may last (`outage_s`, ORCHESTRATOR_STORAGE_OUTAGE_S, 30 minutes
unless set), and an outage is said once when it starts and once when it ends, never per retry.
Anything else (a bucket that is gone, access denied, a full local disk) is *permanent*: raised at
once, for the caller to report once with what it affects. docs/architecture.md#storage-outages.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator import settings
from orchestrator.errors import ConfigError, StorageUnavailable, last_line

T = TypeVar("T")

OUTAGE_ENV = settings.STORAGE_OUTAGE_S.name
ON_ERROR_ENV = settings.ON_STORAGE_ERROR.name
DEFAULT_OUTAGE_S = 1800.0
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 10.0

# Error codes of S3 (and S3-compatible stores) that mean "try again".
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
    "ServiceUnavailable", "InternalError", "OperationAborted",
    "ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired",
})  # fmt: skip
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE, errno.EAGAIN,
})  # fmt: skip


class StorageSettings(BaseModel):
    """How a job's processes treat storage errors; chosen at push, recorded with the job."""

    model_config = ConfigDict(extra="ignore")  # stored with the job: newer keys are ignored

    # How long a transient outage is ridden out before it is treated as permanent.
    outage_s: float = Field(default=DEFAULT_OUTAGE_S, gt=0)
    # A permanent error (or an outage past outage_s): the commands go on, or the job is stopped.
    on_error: Literal["continue", "stop"] = "continue"

    @classmethod
    def from_env(cls) -> StorageSettings:
        values = {
            field: os.environ[var]
            for field, var in (("outage_s", OUTAGE_ENV), ("on_error", ON_ERROR_ENV))
            if os.environ.get(var)
        }
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            names = {"outage_s": OUTAGE_ENV, "on_error": ON_ERROR_ENV}
            problems = [
                f"{names[str(err['loc'][0])]}: {err['msg']} (got {err['input']!r})"
                for err in e.errors(include_url=False)
            ]
            raise ConfigError("Invalid storage settings:", problems) from None


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    """Looked up at the first error, not at import: botocore and aiohttp take ~0.3 s to import,
    which a job on a local storage root never needs."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from botocore import exceptions as boto

        types += [boto.ConnectionError, boto.HTTPClientError, boto.CredentialRetrievalError]
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    try:
        from google.auth.exceptions import TransportError

        types.append(TransportError)
    except ImportError:
        pass
    return tuple(types)


def _is_transient_one(e: BaseException) -> bool:
    if isinstance(e, _transient_types()):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _TRANSIENT_CODES or _transient_status(status)
    return _transient_status(getattr(e, "code", None))  # gcsfs's HttpError


def _transient_status(status: object) -> bool:
    return isinstance(status, int) and (status in (408, 429) or 500 <= status <= 599)


# What the call found, not a failure to reach the storage: never tried again, and answered
# without importing the clients' error types (a job's first read of a file not written yet is
# one: 0.15 s on the path to its first line).
_ANSWERS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def is_transient(e: BaseException) -> bool:
    """Whether an error from a storage call may pass if tried again (its causes included:
    s3fs turns a 503 SlowDown into an OSError whose cause is botocore's error)."""
    if isinstance(e, _ANSWERS):
        return False
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen or isinstance(current, StorageUnavailable):
            continue
        seen.add(id(current))
        if _is_transient_one(current):
            return True
        stack += [current.__cause__, current.__context__]
    return False


def describe(e: BaseException) -> str:
    """An error in one line: `EndpointConnectionError: Could not connect to ...`."""
    return f"{type(e).__name__}: {last_line(e)}".rstrip(": ")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StorageRetry:
    """How one process's calls to one storage root ride out an outage; shared by its threads.

    `say` gets one line when an outage starts and one when it ends. `give_up_at` (monotonic) is
    a deadline a caller may set, a final flush's say, after which waiting calls stop retrying.
    """

    def __init__(
        self,
        url: str,
        budget_s: float | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self.budget_s = budget_s if budget_s is not None else _budget_from_env()
        self.say = say or _stderr
        self.give_up_at: float | None = None
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the outage in progress
        self._since_wall = 0.0

    @property
    def in_outage(self) -> bool:
        return self._since is not None

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """`fn(*args, **kwargs)`, tried again through transient errors until the outage has
        lasted `budget_s` (then StorageUnavailable); a permanent error is raised at once."""
        wait = FIRST_WAIT_S
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e):
                    raise
                pause = wait / 2 + random.uniform(0, wait / 2)
                if self._failed(e, pause):
                    raise self._unavailable(e) from e
                time.sleep(pause)
                wait = min(wait * 2, MAX_WAIT_S)
                continue
            self._recovered()
            return result

    def _failed(self, e: BaseException, pause: float) -> bool:
        """Note a transient failure; whether to stop retrying (out of budget or time)."""
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                self._since, self._since_wall = now, time.time()
                self.say(
                    f"storage root {self.url} unreachable since {_clock(self._since_wall)} "
                    f"({describe(e)}): retrying for up to {self.budget_s:g} s"
                )
            over_budget = now + pause - self._since > self.budget_s
        past_deadline = self.give_up_at is not None and now + pause > self.give_up_at
        return over_budget or past_deadline

    def _recovered(self) -> None:
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            lasted = time.monotonic() - self._since
            self._since = None
        self.say(f"storage root {self.url} reachable again after {lasted:.0f} s")

    def _unavailable(self, e: BaseException) -> StorageUnavailable:
        since = self._since_wall or time.time()
        return StorageUnavailable(
            f"the storage root {self.url} has been unreachable since {_clock(since)} "
            f"({time.time() - since:.0f} s): {describe(e)}"
        )


def _budget_from_env() -> float:
    try:
        return StorageSettings.from_env().outage_s
    except ConfigError:
        return DEFAULT_OUTAGE_S


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))
