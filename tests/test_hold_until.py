"""How long an interactive session keeps a job's nodes once its commands end (`hold_until`)."""

from __future__ import annotations

from orchestrator.controller.session import FOREVER_S, hold_until
from orchestrator.spec.training import InteractiveSession, InteractiveSessionTrigger

NOW = 1_000_000.0
STARTED = NOW - 600  # the commands started ten minutes ago


def session(trigger: InteractiveSessionTrigger, minutes: int = 60) -> InteractiveSession:
    return InteractiveSession(trigger=trigger, timeout_minutes=minutes)


def test_without_a_session_or_a_request_the_nodes_are_released():
    assert hold_until(None, failed=True, started_at=STARTED, requested=None, now=NOW) is None


def test_on_failure_holds_a_failed_job_from_now_and_releases_a_succeeded_one():
    on_failure = session(InteractiveSessionTrigger.ON_FAILURE)
    assert hold_until(on_failure, True, STARTED, None, NOW) == NOW + 3600
    assert hold_until(on_failure, False, STARTED, None, NOW) is None


def test_on_startup_holds_from_when_the_commands_started_however_they_ended():
    on_startup = session(InteractiveSessionTrigger.ON_STARTUP)
    assert hold_until(on_startup, False, STARTED, None, NOW) == STARTED + 3600
    assert hold_until(on_startup, True, STARTED, None, NOW) == STARTED + 3600
    # Its time was up while the commands ran: nothing is held.
    assert hold_until(session(InteractiveSessionTrigger.ON_STARTUP, 5), False, STARTED, None,
                      NOW) is None  # fmt: skip


def test_on_demand_holds_only_as_long_as_isession_asked():
    on_demand = session(InteractiveSessionTrigger.ON_DEMAND)
    assert hold_until(on_demand, True, STARTED, None, NOW) is None
    assert hold_until(on_demand, False, STARTED, NOW + 120, NOW) == NOW + 120
    assert hold_until(on_demand, False, STARTED, NOW - 1, NOW) is None  # asked, but past


def test_a_request_extends_a_hold_and_never_shortens_one():
    on_failure = session(InteractiveSessionTrigger.ON_FAILURE)
    assert hold_until(on_failure, True, STARTED, NOW + 7200, NOW) == NOW + 7200
    assert hold_until(on_failure, True, STARTED, NOW + 60, NOW) == NOW + 3600


def test_a_timeout_of_minus_one_holds_for_ten_years_as_baseten_does():
    forever = session(InteractiveSessionTrigger.ON_FAILURE, minutes=-1)
    assert hold_until(forever, True, STARTED, None, NOW) == NOW + FOREVER_S
