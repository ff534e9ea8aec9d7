"""The cluster's job queue: its policy (pure), its view of Ray, and its service actor."""

QUEUE_SERVICE_NAME = "orchestrator-queue"  # the service actor, in the `orchestrator` namespace
