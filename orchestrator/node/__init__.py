"""Node libraries: what the actors in `agents/` do on a node, without being actors.

Weight sources, secrets, checkpoint rules, mounts, the training cache's links, metrics, output
splitting and terminals: plain code, testable without Ray, used by the agents and by serving.
"""
