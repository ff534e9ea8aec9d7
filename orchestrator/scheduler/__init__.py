"""The job queue of a shared cluster: priorities, team quotas, fair share, preemption."""
