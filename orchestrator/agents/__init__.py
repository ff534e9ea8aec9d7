"""Node agents: Ray actors that do the work on each node of a job."""
