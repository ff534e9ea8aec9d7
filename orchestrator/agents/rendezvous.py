"""Leader and ranks: each node agent registers its address; all learn the group at once.

The `join` call returns only when every rank has joined, so it is also the barrier before any
rank starts its commands. Rank 0 (bundle 0) is the leader; the port it offers becomes
MASTER_PORT for everyone, chosen once.
"""

from __future__ import annotations

import asyncio
import socket

from orchestrator.agents.messages import Group


class Rendezvous:
    """A Ray actor (async), one per job."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.addresses: dict[int, str] = {}
        self.master_port: int | None = None
        self._everyone = asyncio.Event()

    async def join(self, rank: int, address: str, offered_port: int | None) -> Group:
        self.addresses[rank] = address
        if rank == 0:
            self.master_port = offered_port
        if len(self.addresses) == self.group_size:
            self._everyone.set()
        await self._everyone.wait()
        return Group(
            leader_addr=self.addresses[0],
            master_port=self.master_port,
            addresses=tuple(self.addresses[r] for r in range(self.group_size)),
        )


def free_port() -> int:
    """A TCP port free on this node right now (the leader offers it for torch.distributed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def group_environment(rank: int, group: Group, gpus_per_node: int) -> dict[str, str]:
    """BT_* group variables plus the names torchrun and torch.distributed read."""
    size = len(group.addresses)
    return {
        "BT_GROUP_SIZE": str(size),
        "BT_NODE_RANK": str(rank),
        "BT_LEADER_ADDR": group.leader_addr,
        "MASTER_ADDR": group.leader_addr,
        "MASTER_PORT": str(group.master_port),
        "NNODES": str(size),
        "NODE_RANK": str(rank),
        "NPROC_PER_NODE": str(max(gpus_per_node, 1)),
    }
