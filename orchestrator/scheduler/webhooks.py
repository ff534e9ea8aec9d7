"""Webhook deliveries, in the queue service: each storage root's jobs' events (job_events.py)
queued in the root's outbox, then POSTed as signed JSON to each subscription that wants them.

- **Once per event.** An event is queued once (its id: job, attempt, kind); a delivery is
  recorded in the root once the receiver answered 2xx, and a restarted service reads the
  outbox and the deliveries back, so it sends only what was not delivered. (A service killed
  between the receiver's answer and that record sends it again: `X-Orchestrator-Delivery` is the
  id a receiver may drop a repeat by.)
- **In order per job.** A job's next event to a subscription waits until the one before it
  was delivered or given up; different jobs do not wait for each other.
- **Through outages.** A receiver that cannot be reached, times out or answers 408, 429 or 5xx
  is tried again with backoff (1 s doubling to 30 s), for a day before the event is given up; a
  4xx is given up after 3 tries. Every delivery, and every event given up, is an audit event
  (verb `notify`).
- **Signed.** `X-Orchestrator-Signature: sha256=<hex>` is the HMAC-SHA256 of the body with the
  subscription's secret, read from the secret store at each delivery, never stored.

One service delivers per root (the lease in notify/deliverer.json): two clusters sharing a root
do not both deliver.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from orchestrator.errors import JobNotFound
from orchestrator.node.secrets import resolve_secret
from orchestrator.scheduler.job_events import events_of
from orchestrator.storage import audit, layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.notify_store import (
    Delivery,
    NotifyEvent,
    NotifyStore,
    Outcome,
    Subscription,
)
from orchestrator.storage.records import JobRecord
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

log = logging.getLogger(__name__)

PASS_S = 0.2  # deliveries due are looked for this often
SCAN_S = {True: 1.0, False: 5.0}  # jobs' statuses read this often: a local root, an object store
LEASE_CHECK_S = 5.0
POST_TIMEOUT_S = 10.0
STORAGE_BUDGET_S = 10.0  # a storage outage fails the pass, tried again at the next
Secrets = Callable[[str, "str | None"], str]  # (name, team) -> value
Post = Callable[[str, bytes, dict[str, str], float], "Answer"]


@dataclass(frozen=True)
class Backoff:
    """How a failing receiver is tried again."""

    first_s: float = 1.0
    cap_s: float = 30.0
    give_up_after_s: float = 24 * 3600.0  # an event this old whose try failed: given up
    refused_tries: int = 3  # answered 4xx (not 408, 429) this often: given up

    def delay(self, failures: int) -> float:
        return min(self.cap_s, self.first_s * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class Answer:
    """How one POST went: delivered, worth trying again, or refused for good."""

    ok: bool
    retry: bool
    text: str  # "HTTP 200", "HTTP 503", "connection refused", ...


def sign(body: bytes, secret: str) -> str:
    """The signature header's value: `sha256=` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def headers_for(event: NotifyEvent, body: bytes, secret: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "orchestrator-webhooks",
        "X-Orchestrator-Event": event.kind,
        "X-Orchestrator-Delivery": event.id,
        "X-Orchestrator-Signature": sign(body, secret),
    }


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a 3xx is the answer: a webhook's URL is the one to POST to


_OPENER = urllib.request.build_opener(_NoRedirects)


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Answer:
    """POST `body` to `url`; any 2xx is delivered."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as reply:
            return Answer(200 <= reply.status < 300, False, f"HTTP {reply.status}")
    except urllib.error.HTTPError as e:
        code = e.code
        e.close()
        retry = code in (408, 429) or code >= 500
        return Answer(False, retry, f"HTTP {code}")
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out, no such host
        reason = getattr(e, "reason", e)
        return Answer(False, True, str(reason) or type(reason).__name__)
    except ValueError as e:  # not a URL urllib can POST to
        return Answer(False, False, str(e))


@dataclass
class _Job:
    """What the deliverer holds of one job: its record, queued events, deliveries done."""

    record: JobRecord
    events: list[NotifyEvent]
    done: dict[tuple[int, str], Delivery]
    ended: bool = False  # its end was seen and its events queued


@dataclass
class _Unrecorded:
    """A delivery whose record (or audit event) a storage outage kept out: written later."""

    job_id: str
    seq: int
    delivery: Delivery
    event: NotifyEvent
    stored: bool = False


@dataclass
class _Health:
    failures: int = 0
    next_at: float = 0.0  # monotonic


@dataclass
class WebhookDeliverer:
    """One storage root's webhooks: `step` reads what changed and starts the deliveries due;
    `start` runs it on a thread of its own until `close`."""

    root: StorageRoot
    holder: str  # who delivers (the Ray session): a restarted service takes over at once
    secrets: Secrets = resolve_secret
    backoff: Backoff = field(default_factory=Backoff)
    post: Post = post
    scan_s: float | None = None  # None: SCAN_S for the root's kind
    timeout_s: float = POST_TIMEOUT_S

    def __post_init__(self) -> None:
        self.store = NotifyStore(self.root)
        self.job_store = JobStore(self.root)
        self.subs: dict[str, Subscription] = {}
        self.jobs: dict[str, _Job] = {}
        self.settled: set[str] | None = None  # read at the first scan
        self.unreadable: set[str] = set()
        self.tries: dict[tuple[str, int, str], int] = {}  # (job, seq, subscription): tries
        self.health: dict[str, _Health] = {}
        self.unrecorded: list[_Unrecorded] = []
        self.in_flight: set[str] = set()
        self.lock = threading.Lock()
        self.recording = threading.Lock()
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="webhook")
        self.held, self.lease_at, self.scan_at = False, 0.0, 0.0
        if self.scan_s is None:
            self.scan_s = SCAN_S[self.root.is_local]
        self._thread: threading.Thread | None = None

    @classmethod
    def for_root(cls, url: str, holder: str) -> WebhookDeliverer:
        return cls(StorageRoot(url, StorageRetry(url, STORAGE_BUDGET_S)), holder)

    # -- running --------------------------------------------------------------------------------

    def start(self, pass_s: float = PASS_S) -> None:
        def run() -> None:
            while not self.stopping.wait(pass_s):
                try:
                    self.step()
                except Exception:  # a storage outage: said, and tried again at the next pass
                    traceback.print_exc()

        self._thread = threading.Thread(target=run, name=f"webhooks {self.root.url}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop after the deliveries under way (their records written)."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join()
        self.pool.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self._record_unrecorded()

    @property
    def busy(self) -> bool:
        """Whether a delivery is owed: it keeps its root watched (and the service alive)."""
        with self.lock:
            return bool(self.unrecorded or self.in_flight) or any(
                self._next(job, sub) is not None
                for job in self.jobs.values() for sub in self.subs.values()
            )  # fmt: skip

    def step(self) -> None:
        """A root without subscriptions costs one listing per scan, and holds no lease."""
        now = time.monotonic()
        scan = now >= self.scan_at
        if scan:
            subs = {s.id: s for s in self.store.subscriptions()}
            with self.lock:
                self.subs = subs
            self.scan_at = now + (self.scan_s or 0.0)
        if not self.subs and not self.unrecorded:
            return
        if now >= self.lease_at:
            self.held = self.store.hold(self.holder)
            self.lease_at = now + LEASE_CHECK_S
        if not self.held:
            return
        self._record_unrecorded()
        if scan and self.subs:
            self._scan()
        with self.lock:
            due = [s for s in self.subs.values() if s.id not in self.in_flight
                   and self.health.setdefault(s.id, _Health()).next_at <= now
                   and any(self._next(j, s) is not None for j in self.jobs.values())]  # fmt: skip
            self.in_flight.update(s.id for s in due)
        for sub in due:
            self.pool.submit(self._deliver_all, sub)

    # -- what to deliver ------------------------------------------------------------------------

    def _scan(self) -> None:
        """Each job not settled: its new events (those a subscription wants) into the outbox."""
        subs = self.subs
        if self.settled is None:
            self.settled = self.store.settled()
        for job_id in self.root.list_names(layout.jobs()):
            if (
                job_id in self.settled
                or job_id in self.unreadable
                or (job_id in self.jobs and self.jobs[job_id].ended)
            ):
                continue
            try:
                status = self.job_store.status(job_id)
                job = self.jobs.get(job_id) or self._load(job_id)
            except (JobNotFound, FileNotFoundError):  # being created: its record comes next
                continue
            except ValueError:  # a record or status this version cannot read: told of nothing
                log.warning("webhooks: job %s in %s cannot be read", job_id, self.root.url)
                self.unreadable.add(job_id)
                continue
            wanted = [e for e in events_of(job.record, status)
                      if any(s.wants(e) for s in subs.values())]  # fmt: skip
            if any(e.id not in {q.id for q in job.events} for e in wanted):
                queued = self.store.queue(job_id, wanted, job.events)
                with self.lock:
                    job.events = queued
            job.ended = status.state.is_terminal
            with self.lock:
                self.jobs.setdefault(job_id, job)
        self._settle()

    def _load(self, job_id: str) -> _Job:
        return _Job(self.job_store.record(job_id), self.store.events(job_id),
                    self.store.deliveries(job_id))  # fmt: skip

    def _settle(self) -> None:
        """Ended jobs with nothing owed: marked settled, never read again."""
        assert self.settled is not None
        with self.lock:
            done = [i for i, job in self.jobs.items() if job.ended
                    and all(self._next(job, s) is None for s in self.subs.values())
                    and not any(u.job_id == i for u in self.unrecorded)]  # fmt: skip
        for job_id in done:
            self.store.settle(job_id, time.time())
            self.settled.add(job_id)
            with self.lock:
                del self.jobs[job_id]

    def _next(self, job: _Job, sub: Subscription) -> NotifyEvent | None:
        """The job's first event `sub` wants and has not had (under the lock)."""
        for event in job.events:
            if (event.seq, sub.id) not in job.done and sub.wants(event):
                return event
        return None

    # -- delivering -----------------------------------------------------------------------------

    def _deliver_all(self, sub: Subscription) -> None:
        """Deliver to `sub` what is due, oldest job head first, until a try fails."""
        try:
            while not self.stopping.is_set() and sub.id in self.subs:  # removed: nothing more
                with self.lock:
                    heads = [(e, i) for i, j in self.jobs.items()
                             if (e := self._next(j, sub)) is not None]  # fmt: skip
                if not heads:
                    return
                event, job_id = min(heads, key=lambda h: (h[0].at, h[1], h[0].seq))
                if not self._deliver(sub, job_id, event):
                    return
        except Exception:
            traceback.print_exc()
        finally:
            with self.lock:
                self.in_flight.discard(sub.id)

    def _deliver(self, sub: Subscription, job_id: str, event: NotifyEvent) -> bool:
        """One try; True if the event is done with (delivered, or given up)."""
        key = (job_id, event.seq, sub.id)
        self.tries[key] = tries = self.tries.get(key, 0) + 1
        body = event.body()
        try:
            secret = self.secrets(sub.secret, sub.team)
        except Exception as e:  # not set (yet): tried again, as a receiver that is down
            answer = Answer(False, True, f"secret {sub.secret!r}: {e}")
        else:
            answer = self.post(sub.url, body, headers_for(event, body, secret), self.timeout_s)
        health = self.health.setdefault(sub.id, _Health())
        if answer.ok:
            health.failures, health.next_at = 0, 0.0
            self._done(job_id, event, sub, "delivered", tries, answer.text)
            return True
        health.failures += 1
        health.next_at = time.monotonic() + self.backoff.delay(health.failures)
        refused = not answer.retry and tries >= self.backoff.refused_tries
        if refused or time.time() - event.at >= self.backoff.give_up_after_s:
            # The next event goes on at once: an older one, tried once more, is given up too.
            self._done(job_id, event, sub, "given up", tries, answer.text)
            return True
        log.info("webhook %s: %s to %s failed (try %d): %s", sub.id, event.id, sub.url, tries,
                 answer.text)  # fmt: skip
        return False

    def _done(self, job_id: str, event: NotifyEvent, sub: Subscription, outcome: Outcome,
              tries: int, answer: str) -> None:  # fmt: skip
        delivery = Delivery(event=event.id, subscription=sub.id, outcome=outcome,
                            at=time.time(), tries=tries, answer=answer)  # fmt: skip
        self.tries.pop((job_id, event.seq, sub.id), None)
        with self.lock:
            self.jobs[job_id].done[(event.seq, sub.id)] = delivery
            self.unrecorded.append(_Unrecorded(job_id, event.seq, delivery, event))
        self._record_unrecorded()

    def _record_unrecorded(self) -> None:
        """The deliveries' records, then their audit events (a storage outage: the next pass)."""
        with self.recording:  # one writer: each record and audit event written once
            with self.lock:
                pending = list(self.unrecorded)
            for item in pending:
                if not item.stored:
                    self.store.record_delivery(item.job_id, item.seq, item.delivery)
                    item.stored = True
                _audit(self.root, item.event, item.delivery)
                with self.lock:
                    self.unrecorded.remove(item)


def _audit(root: StorageRoot, event: NotifyEvent, delivery: Delivery) -> None:
    if delivery.outcome == "delivered":
        result = "ok"
    else:
        result = f"failed: given up after {delivery.tries} tries: {delivery.answer}"
    audit.append(root, audit.AuditEvent(
        at=delivery.at, verb="notify", result=result, user=_user(), host=socket.gethostname(),
        job=event.job_id, project=event.project, team=event.team, target=delivery.subscription,
        detail=f"{event.kind} {delivery.outcome} (attempt {event.attempt})",
    ))  # fmt: skip


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


class Webhooks:
    """The queue service's deliverers, one per storage root it watches; a root it lets go of
    keeps its deliverer until nothing is owed. `holder` None (a service outside Ray, in
    tests): none at all."""

    def __init__(
        self, holder: str | None,
        make: Callable[[str, str], WebhookDeliverer] = WebhookDeliverer.for_root,
    ) -> None:  # fmt: skip
        self.holder, self.make = holder, make
        self.deliverers: dict[str, WebhookDeliverer] = {}
        self.letting_go: set[str] = set()
        self.lock = threading.Lock()
        if holder is not None:
            threading.Thread(target=self._reaping, name="webhooks-reaper", daemon=True).start()

    def watch(self, root: str) -> None:
        if self.holder is None:
            return
        with self.lock:
            self.letting_go.discard(root)
            if root in self.deliverers:
                return
            self.deliverers[root] = deliverer = self.make(root, self.holder)
        deliverer.start()

    def let_go(self, root: str) -> None:
        with self.lock:
            self.letting_go.add(root)

    def busy_roots(self) -> set[str]:
        with self.lock:
            deliverers = dict(self.deliverers)
        return {root for root, d in deliverers.items() if d.busy}

    def _reaping(self) -> None:
        """Ends the deliverers of roots let go of once they owe nothing."""
        while True:
            time.sleep(LEASE_CHECK_S)
            with self.lock:
                idle = [r for r in self.letting_go
                        if r in self.deliverers and not self.deliverers[r].busy]  # fmt: skip
                ended = [self.deliverers.pop(r) for r in idle]
                self.letting_go -= set(idle)
            for deliverer in ended:
                deliverer.close()
