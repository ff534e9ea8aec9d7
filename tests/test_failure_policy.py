"""The failure policy: what each recorded fault means for the job, without Ray."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.controller.failure_policy import Action, FailurePolicy, Fault, FaultKind
from orchestrator.lifecycle import TRANSITIONS, JobState
from orchestrator.storage.records import RetryPolicy

NODE = Fault(FaultKind.NODE_LOST, "rank 1's node was lost", 1, "n1")
AGENT = Fault(FaultKind.AGENT_LOST, "rank 0's node agent died", 0, "n0")
PREEMPTED = Fault(FaultKind.PREEMPTED, "rank 1's node is being preempted", 1, "n1")
FAILED = Fault(FaultKind.COMMAND_FAILED, "rank 0: command exited with code 1", 0)


def test_lost_nodes_and_agents_are_retried_until_the_budget_is_spent():
    policy = FailurePolicy(RetryPolicy(retries=2))
    assert policy.decide(NODE).action == Action.RETRY
    assert policy.decide(AGENT, [NODE]).why == "retry 2 of 2"
    spent = policy.decide(NODE, [NODE, AGENT])
    assert (spent.action, spent.state) == (Action.END, JobState.FAILED)
    assert spent.why == "retries spent (2 of 2)"


def test_no_retries_by_default_says_how_to_allow_them():
    decision = FailurePolicy(RetryPolicy()).decide(NODE)
    assert (decision.action, decision.state) == (Action.END, JobState.FAILED)
    assert "--retries" in decision.why and "ORCHESTRATOR_MAX_RETRIES" in decision.why


def test_preemptions_do_not_use_the_budget_but_are_capped():
    policy = FailurePolicy(RetryPolicy(retries=1, max_preemptions=2))
    assert policy.decide(PREEMPTED, [PREEMPTED]).action == Action.RETRY
    assert policy.decide(NODE, [PREEMPTED, PREEMPTED]).action == Action.RETRY  # budget intact
    capped = policy.decide(PREEMPTED, [PREEMPTED, NODE, PREEMPTED])
    assert (capped.action, capped.state) == (Action.END, JobState.PREEMPTED)
    assert FailurePolicy(RetryPolicy()).decide(PREEMPTED).action == Action.RETRY  # spot: always


def test_a_failed_command_waits_and_retries_only_when_asked():
    assert FailurePolicy(RetryPolicy(retries=5)).decide(FAILED).state == JobState.FAILED
    policy = FailurePolicy(RetryPolicy(retries=2, retry_on_failure=True, delay_s=7))
    wait = policy.decide(FAILED, [NODE])
    assert (wait.action, wait.delay_s, wait.why) == (Action.WAIT, 7, "retry 2 of 2")
    assert policy.decide(FAILED, [NODE, FAILED]).action == Action.END


def test_a_stop_is_never_retried():
    stop = Fault(FaultKind.STOPPED, "stopped by user")
    decision = FailurePolicy(RetryPolicy(retries=9, retry_on_failure=True)).decide(stop)
    assert (decision.action, decision.state) == (Action.END, JobState.STOPPED)


def test_the_documented_state_machine_is_the_one_the_code_enforces():
    """docs/architecture.md's diagram and lifecycle.TRANSITIONS change together."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    diagram = doc.split("stateDiagram-v2", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"^\s*([A-Z_]+) --> ([A-Z_]+):", diagram, re.M))
    allowed = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == allowed
