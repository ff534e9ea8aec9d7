"""Webhooks through a receiver outage of 30 s and restarts of the deliverer (what a restarted
queue service does: a new deliverer over the same storage root), no Ray: every event reaches
the receiver once, in order per job, though the receiver refuses connections for 30 s and then
answers 500 to every third request. About 40 s; the backoff's cap is 4 s here (30 s in the
service) so the test does not wait out a full step after the receiver is back."""

from __future__ import annotations

import time
from collections import Counter

from conftest import eventually, free_port
from notify_jobs import SECRET, JobScript, Receiver

from orchestrator.client.notify import add_webhook
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.webhooks import Backoff, WebhookDeliverer, post
from orchestrator.storage import audit
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.notify_store import NotifyStore
from orchestrator.storage.root import StorageRoot

OUTAGE_S = 30.0


ANSWERS: list[str] = []  # every try's answer, as the deliverers saw it


def counted(url: str, body: bytes, headers: dict[str, str], timeout: float):
    answer = post(url, body, headers, timeout)
    ANSWERS.append(answer.text)
    return answer


def started(root: StorageRoot) -> WebhookDeliverer:
    d = WebhookDeliverer(root, "session-1", secrets=lambda name, team: SECRET, post=counted,
                         backoff=Backoff(first_s=1.0, cap_s=4.0), scan_s=0.2)  # fmt: skip
    d.start(pass_s=0.05)
    return d


def test_a_30_s_outage_500s_and_restarts_lose_no_event_and_repeat_none(tmp_path):
    root = StorageRoot(tmp_path / "root")
    receiver = Receiver(free_port(), fail_every=3)  # down until OUTAGE_S: connections refused
    sub = add_webhook(receiver.url, secret="hook_key", storage_root=root.url)
    store = JobStore(root)
    begin = time.monotonic()
    d = started(root)
    try:
        a, b, c = (JobScript(store, f"j{n}", team="red").run() for n in "abc")
        a.end_attempt("preempted_by_job", "gave way", "gave way").to(JobState.PENDING)
        b.end_attempt(None, decision="completed").to(JobState.COMPLETED)
        c.end_attempt("stuck", "rank 0 silent").to(JobState.PENDING)
        eventually(lambda: len(NotifyStore(root).events("ja")) == 1, "the outbox filled", 10)
        time.sleep(8)
        d.close()  # the service restarts during the outage
        d = started(root)
        a.run().end_attempt("stuck", "rank 1 silent").to(JobState.PENDING)
        c.run().end_attempt("command_failed", "exit 3", "ended").fail("exit 3")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - begin)))
        receiver.up()
        eventually(lambda: len(receiver.ids()) >= 2, "the first deliveries after the outage", 15)
        d.close()  # and again, between deliveries
        d = started(root)
        a.run().end_attempt(None, decision="completed").to(JobState.COMPLETED)
        want = {"ja": ["ja:0:preempted", "ja:1:stuck", "ja:2:completed"],
                "jb": ["jb:0:completed"], "jc": ["jc:0:stuck", "jc:1:failed"]}  # fmt: skip
        eventually(lambda: sorted(receiver.ids()) == sorted(i for e in want.values() for i in e),
                   "every event delivered", 30)  # fmt: skip
        eventually(lambda: not d.busy, "nothing owed")
        time.sleep(1.0)  # nothing more comes
    finally:
        d.close()
        receiver.down()
    got = receiver.ids()
    assert Counter(got).most_common(1)[0][1] == 1, got
    for job, events in want.items():
        assert [i for i in got if i.startswith(f"{job}:")] == events
    assert receiver.bad_signatures == 0
    assert receiver.requests > len(got)  # some were answered 500 and tried again
    refused = [a for a in ANSWERS if "refused" in a.lower()]
    assert len(refused) >= 8, ANSWERS  # tried through the outage, backing off (1, 2, 4, 4 s ...)
    assert ANSWERS.count("HTTP 500") == receiver.requests - len(got)
    for body in receiver.accepted:
        assert body["team"] == "red" and body["project"] == "demo"
    notified = [(e.job, e.detail, e.result, e.target) for e in audit.read(root)
                if e.verb == "notify"]  # fmt: skip
    assert sorted(notified) == sorted(
        (i.split(":")[0], f"{i.split(':')[2]} delivered (attempt {i.split(':')[1]})", "ok", sub.id)
        for i in got
    )
    assert NotifyStore(root).settled() == {"ja", "jb", "jc"}
