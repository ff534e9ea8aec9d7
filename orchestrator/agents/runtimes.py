"""Where a job's ranks run (`JobRuntime`): in each node's own environment (`HostRuntime`), in a
podman container of the job's image (`ContainerRuntime`), or on agents Ray starts in that image
(`ImageUriRuntime`, Ray's `image_uri`).

The cluster chooses the kind (ORCHESTRATOR_JOB_RUNTIME, ORCHESTRATOR_USE_IMAGE_URI on the head);
`runtime_for` makes the job's runtime from it once, the controller asks it what to say, what it
cannot do, what the nodes pull and what the agents start with, and each rank's StartRequest
carries it to the node agent, which runs the rank's program in the rank's runtime on its node
(`on_node`: node/rank_runtime.py). The queue service asks the kind whether waiting jobs' images
are pulled ahead and what its beat says, and push what to say of it. No other module reads the
settings that choose it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from orchestrator import settings
from orchestrator.agents.messages import ImageRequest

# The node side is imported where a node uses it: the controller and push import this module.
if TYPE_CHECKING:
    from orchestrator.node.rank_runtime import ImagePull, RankPlace, RankRuntime
    from orchestrator.spec.training import TrainingJob


class RuntimeKind(str, enum.Enum):
    HOST = "host"
    CONTAINER = "container"
    IMAGE_URI = "image_uri"

    @property
    def nodes_pull_images(self) -> bool:
        """Whether the nodes pull jobs' images themselves (node/image_cache.py), so a waiting
        job's can be pulled before it is admitted."""
        return self is RuntimeKind.CONTAINER

    @property
    def node_tools(self) -> tuple[str, ...]:
        """The programs every node needs for this kind (`orchestrator doctor` looks for them):
        podman, and runc where cgroups v1 make podman run it (node/podman.py); podman for Ray's
        image_uri."""
        if self is RuntimeKind.CONTAINER:
            return ("podman", "runc")
        return ("podman",) if self is RuntimeKind.IMAGE_URI else ()

    @property
    def said(self) -> str:
        """Where the commands run, as the queue service's beat tells clients (ServiceBeat's
        runtime, storage/queue_store.py): the cluster's ORCHESTRATOR_JOB_RUNTIME, "host" or
        "container" (an image_uri cluster's is "host")."""
        return "container" if self is RuntimeKind.CONTAINER else "host"


def cluster_runtime_kind() -> RuntimeKind:
    """This cluster's kind, from its settings (as the head and every node have them)."""
    if settings.JOB_RUNTIME.get() == "container":
        return RuntimeKind.CONTAINER
    return RuntimeKind.IMAGE_URI if settings.USE_IMAGE_URI.get() else RuntimeKind.HOST


@dataclass(frozen=True)
class JobRuntime:
    """One job's runtime: its image, and what the job's controller and agents do for it."""

    image: str = ""  # the job's base_image
    kind: ClassVar[RuntimeKind]

    def notice(self) -> str:
        """The job log's line on where its commands run."""
        raise NotImplementedError

    def problem(self) -> str | None:
        """What this runtime cannot do for the job, said before anything is placed."""
        return None

    def image_request(self) -> ImageRequest | None:
        """The image each node pulls while it is prepared; None: nothing to pull."""
        return None

    def on_node(self, place: RankPlace) -> RankRuntime:
        """Where one rank's processes run on its node, once it is prepared (`place`): here, in
        the agent's environment (the node's, or the image's where Ray started the agent in it)."""
        from orchestrator.node.rank_runtime import ON_HOST

        return ON_HOST

    def agent_runtime_env(self) -> dict[str, str] | None:
        """The Ray runtime_env the job's node agents start with; None: the node's own."""
        return None

    @property
    def agents_in_image(self) -> bool:
        """Whether the agents run in an environment of the job's (no worker of the node's
        environment, started ahead, can be one of them)."""
        return self.agent_runtime_env() is not None


@dataclass(frozen=True)
class HostRuntime(JobRuntime):
    """The commands run in each node's own environment, as trusted code."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.HOST

    def notice(self) -> str:
        return (
            f"image {self.image} is recorded; this cluster runs jobs in each node's own "
            "environment, as trusted code: their commands can reach the cluster and read what "
            f"Ray's user can on the node (set {settings.JOB_RUNTIME.name}=container on a "
            "cluster with podman to run them in the image; docs/secrets.md)"
        )


@dataclass(frozen=True)
class ContainerRuntime(JobRuntime):
    """Each rank's commands run in a podman container of the image (node/podman.py), with the
    compute request's memory and CPUs as its limits."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.CONTAINER
    memory_bytes: int | None = None
    cpus: float | None = None
    registry: str | None = None  # docker_auth's REGISTRY_SECRET: its registry and secret
    secret_name: str | None = None
    unsupported_auth: str | None = None  # a docker_auth method containers cannot use yet

    def notice(self) -> str:
        return f"image {self.image}: each rank's commands run in a container of it (podman)"

    def problem(self) -> str | None:
        if settings.USE_IMAGE_URI.get():
            return (
                f"{settings.JOB_RUNTIME.name}=container and {settings.USE_IMAGE_URI.name}=1 "
                "are both set on this cluster: choose one"
            )
        if self.unsupported_auth is not None:
            return (
                f"image.docker_auth with auth_method {self.unsupported_auth} is not supported "
                "in containers yet: use REGISTRY_SECRET (a secret holding username:password "
                "for the registry), or an image the nodes can pull without credentials"
            )
        return None

    def image_request(self) -> ImageRequest:
        return ImageRequest(self.image, registry=self.registry, secret_name=self.secret_name)

    def on_node(self, place: RankPlace) -> RankRuntime:
        from orchestrator.node.rank_runtime import InContainer

        return InContainer.of(place, self.image, self.memory_bytes, self.cpus)


@dataclass(frozen=True)
class ImageUriRuntime(JobRuntime):
    """Ray starts each node agent in the image (a cluster with podman or docker for Ray's
    image_uri), and the commands run in the agent's environment."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.IMAGE_URI

    def notice(self) -> str:
        return f"image {self.image}: each node runs the job in that container (Ray image_uri)"

    def agent_runtime_env(self) -> dict[str, str]:
        return {"image_uri": self.image}


def runtime_for(job: TrainingJob) -> JobRuntime:
    """The job's runtime on this cluster."""
    image = job.image.base_image
    kind = cluster_runtime_kind()
    if kind == RuntimeKind.IMAGE_URI:
        return ImageUriRuntime(image)
    if kind == RuntimeKind.HOST:
        return HostRuntime(image)
    auth = job.image.docker_auth
    registry = secret = unsupported = None
    if auth is not None and auth.registry_secret_docker_auth is not None:
        registry, secret = auth.registry, auth.registry_secret_docker_auth.secret_ref.name
    elif auth is not None:
        unsupported = str(getattr(auth.auth_method, "value", auth.auth_method))
    return ContainerRuntime(
        image, memory_bytes=job.compute.memory_bytes, cpus=job.compute.cpu_count,
        registry=registry, secret_name=secret, unsupported_auth=unsupported,
    )  # fmt: skip


def image_pull(
    request: ImageRequest | None, holder: str, team: str | None, say: Callable[[str], None],
    alive: Callable[[str], bool],
) -> ImagePull:  # fmt: skip
    """What a rank's prepare does for the job's image (`PrepareRequest.image`, from
    `image_request`): pull it for `holder`, saying its lines; nothing without one."""
    from orchestrator.node.rank_runtime import ImagePull, PodmanPull

    if request is None:
        return ImagePull()
    return PodmanPull(request.image, holder, request.registry, request.secret_name, team, say,
                      alive)  # fmt: skip


def push_notices(job: TrainingJob, said: str | None) -> list[str]:
    """What push says of where the commands will run, from what the cluster said
    (`RuntimeKind.said`; None: it has not): on the host, that the image is not used and the
    code is trusted (docs/secrets.md); nothing where they run in the image, or where the
    cluster has not said (its first job's log says it)."""
    if said != RuntimeKind.HOST.said:
        return []
    image = "image.base_image and image.docker_auth are" if job.image.docker_auth else (
        "image.base_image is"
    )  # fmt: skip
    return [
        f"this cluster runs jobs' commands in its nodes' own environment, as trusted code: "
        f"{image} recorded only, and the commands can reach the cluster and read what Ray's "
        "user can on the node (docs/secrets.md)"
    ]
