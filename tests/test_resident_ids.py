"""The controller host's resident Ray job is submitted under a numbered id, so that controllers
asking at once submit one job (controller/host.py); the next number must be free."""

from __future__ import annotations

from orchestrator.controller.host import RESIDENT_PREFIX, next_resident_id


def test_the_next_resident_id_is_past_every_one_listed_even_after_a_delete():
    # The first ended and was deleted (`ray job delete`): two remain, numbered 2 and 3.
    listed = [f"{RESIDENT_PREFIX}2", f"{RESIDENT_PREFIX}3"]
    assert next_resident_id(listed) == f"{RESIDENT_PREFIX}4"  # their count + 1 is 3: in use
    assert next_resident_id([]) == f"{RESIDENT_PREFIX}1"
    # Ids Ray made up (a raysubmit_... or none) or that are not ours do not count.
    assert next_resident_id(
        [None, "raysubmit_ab12", f"{RESIDENT_PREFIX}x9", f"{RESIDENT_PREFIX}9"]
    ) == (f"{RESIDENT_PREFIX}10")
