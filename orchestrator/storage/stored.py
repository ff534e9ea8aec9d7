"""The base of every model written to the storage root."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Stored(BaseModel):
    """Unknown keys are ignored on read, so what a newer version wrote stays readable."""

    model_config = ConfigDict(extra="ignore")
