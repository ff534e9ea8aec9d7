"""The cluster's job queue: its policy (pure), its view of Ray, and its service actor."""

from orchestrator import actor_names

QUEUE_SERVICE_NAME = actor_names.QUEUE_SERVICE
