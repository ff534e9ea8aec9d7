"""The enum-typed fields of stored records: only their values get in, and they read as words.

A record's `cause`, checkpoint `state`, delivery `tier` and mirror outcome are shown to users
(`view`, the checkpoint summary, JSON output), so a value must read "node_lost", never
"FaultKind.NODE_LOST", and a misspelt one must fail where it is written.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from orchestrator.lifecycle import FaultKind
from orchestrator.storage.records import (
    Attempt,
    CheckpointEntry,
    CheckpointSummary,
    DeliveryTier,
    NodeDelivery,
    WeightsStatus,
)


def test_an_enum_value_is_held_and_shown_as_its_word():
    attempt = Attempt(number=0, started_at=1.0, cause=FaultKind.NODE_LOST)
    assert f"cause: {attempt.cause}" == "cause: node_lost"
    assert json.loads(attempt.model_dump_json())["cause"] == "node_lost"
    delivery = NodeDelivery(rank=0, tier=DeliveryTier.CLUSTER, seconds=1.0)
    assert f"from the {delivery.tier} cache" == "from the cluster cache"


def test_a_stored_record_reads_back_the_same():
    entry = CheckpointEntry(rank=1, name="checkpoint-10", state="failed", reason="disk full")
    again = CheckpointEntry.model_validate_json(entry.model_dump_json())
    assert again == entry and again.state == "failed"
    summary = CheckpointSummary.of([entry], {})
    assert summary.failed == {"rank-1/checkpoint-10": "disk full"} and not summary.all_uploaded
    assert summary.problems() == ["rank-1/checkpoint-10: failed: disk full"]


@pytest.mark.parametrize(
    ("model", "fields", "field"),
    [
        (Attempt, {"number": 0, "started_at": 1.0, "cause": "node_gone"}, "cause"),
        (CheckpointEntry, {"rank": 0, "name": "c", "state": "uploded"}, "state"),
        (NodeDelivery, {"rank": 0, "tier": "disk", "seconds": 1.0}, "tier"),
        (WeightsStatus, {"source": "hf://x", "mount_location": "/m", "mirror": "hot"}, "mirror"),
    ],
)
def test_a_misspelt_value_is_refused_naming_the_field(model, fields, field):
    with pytest.raises(ValidationError) as info:
        model(**fields)
    assert info.value.errors()[0]["loc"] == (field,)
