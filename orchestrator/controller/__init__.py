"""The controller: one per job, the entrypoint of its Ray job, driving it through its states."""
