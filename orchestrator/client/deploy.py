"""`deploy_checkpoints` and the deployments it makes: Ray Serve applications, through the dashboard.

Deploying goes through the same HTTP API as `serve deploy` (PUT /api/serve/applications/), so
it works from a laptop against a remote cluster, and the dashboard's Serve page shows the result.
That API takes the whole set of applications: the ones already running are sent back unchanged
beside the new one, and stopping one sends the rest; each read and write-back is made under
`serve_applications_lock` (client/serve_lock.py), so two deploys at once lose neither.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchestrator import settings
from orchestrator.client.api import get_job, latest_job
from orchestrator.client.audit import audited
from orchestrator.client.config_loader import load_deploy_config
from orchestrator.client.connection import Connection, connect, storage
from orchestrator.client.jobs import JobHandle
from orchestrator.client.serve_lock import serve_applications_lock
from orchestrator.errors import ConfigError, DeployError
from orchestrator.serving.plan import (
    TRANSFORMERS_IMPORT_PATH,
    VLLM_IMPORT_PATH,
    Chosen,
    DeploymentPlan,
    application,
    plan_deployment,
    serve_config,
)
from orchestrator.serving.served_model import ServedModel
from orchestrator.spec.deploy import DeployCheckpointsConfig
from orchestrator.storage.checkpoints import Manifest

_OURS = (TRANSFORMERS_IMPORT_PATH, VLLM_IMPORT_PATH)
_FAILED = ("DEPLOY_FAILED", "UNHEALTHY")  # Serve's application statuses of one that failed
_POLL_S = 0.5


@dataclass
class Deployment:
    """A served model: a Ray Serve application answering the OpenAI API under `url`."""

    name: str
    url: str  # the OpenAI base URL: http://host:port/<name>/v1
    model_ids: list[str]
    engine: str
    checkpoints: list[str]  # <job>/rank-<r>/<name>
    status: str = "NOT_STARTED"  # Serve's application status
    message: str = ""
    cause: str = ""  # why it failed, in one line (the replica's error), if it did
    replicas: int = 0  # running
    engine_reason: str = ""
    serve_config: dict[str, Any] = field(default_factory=dict, repr=False)
    _connection: Connection | None = field(default=None, repr=False)

    def refresh(self) -> Deployment:
        found = get_deployment(self.name, connection=self._connection)
        self.status, self.message, self.replicas = found.status, found.message, found.replicas
        self.cause = found.cause
        return self

    def stop(self) -> None:
        stop_deployment(self.name, connection=self._connection)

    def as_dict(self) -> dict[str, Any]:
        keys = ("name", "url", "model_ids", "engine", "engine_reason", "checkpoints", "status",
                "cause", "message", "replicas")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


def deploy_checkpoints(
    config: str | Path | DeployCheckpointsConfig | None = None,
    *,
    job_id: str | None = None,
    checkpoints: list[str] | None = None,
    model_name: str | None = None,
    engine: str = "auto",
    replace: bool = False,
    dry_run: bool = False,
    wait: bool = True,
    timeout: float | None = None,
    address: str | None = None,
    storage_root: str | None = None,
) -> Deployment:
    """Serve checkpoints of a job as an OpenAI-compatible endpoint on the cluster.

    `checkpoints`: names of the job's checkpoints (`latest` for the newest), default: the one
    the job has, an error naming them if it has several. A config's `checkpoint_details` wins
    over `job_id`/`checkpoints`. `dry_run` returns the deployment, with its `serve_config`,
    without deploying. `wait`: return once it is RUNNING, which its replica is only after its
    engine answered a one-token warm-up request (within `timeout`, default
    ORCHESTRATOR_DEPLOY_TIMEOUT_S); a DeployError with the engine's root cause if it failed.
    """
    plan = plan_from(config, job_id=job_id, checkpoints=checkpoints, model_name=model_name,
                     engine=engine, storage_root=storage_root)  # fmt: skip
    return deploy_plan(plan, replace=replace, dry_run=dry_run, wait=wait, timeout=timeout,
                       address=address, storage_root=storage_root)  # fmt: skip


def deploy_plan(
    plan: DeploymentPlan,
    *,
    replace: bool = False,
    dry_run: bool = False,
    wait: bool = True,
    timeout: float | None = None,
    address: str | None = None,
    storage_root: str | None = None,
) -> Deployment:
    """Deploy what `plan_from` planned (the CLI plans once, asks for a name, then deploys)."""
    app = application(plan)
    if dry_run:
        host = settings.SERVE_HOST.get() or "0.0.0.0"
        return _deployment(plan, serve_config([app], host, settings.SERVE_PORT.get()), "", None)
    served = [c.key for c in plan.model.checkpoints]  # <job>/rank-<r>/<name>
    with audited(storage(storage_root), "deploy", target=plan.name,
                 job=served[0].split("/")[0] if served else None,
                 detail=", ".join(served)):  # fmt: skip
        return _deploy(plan, app, replace, wait, timeout, address)


def _deploy(
    plan: DeploymentPlan, app: dict[str, Any], replace: bool, wait: bool,
    timeout: float | None, address: str | None,
) -> Deployment:  # fmt: skip
    connection = connect(address)
    client = _serve_client(connection)
    with serve_applications_lock(connection.address):  # read, add ours, write back: one at a time
        details = _details(client)
        running = _applications(details)
        if plan.name in running and not replace:
            raise DeployError(
                f"a deployment named {plan.name!r} is already running: pick another model name "
                "(--model-name), stop it (`orchestrator deployments stop "
                f"{plan.name}`), or replace it (--replace)"
            )
        others = [a["deployed_app_config"] for n, a in running.items() if n != plan.name]
        if any(c is None for c in others):
            raise DeployError(
                "Serve applications deployed with serve.run() are running on this cluster; Ray "
                "Serve cannot deploy from a config beside them: shut them down first"
            )
        host, port = _http_options(details, connection)
        config_sent = serve_config([*others, app], host, port)
        try:
            client.deploy_applications(config_sent)
        except Exception as e:
            raise DeployError(f"Ray Serve refused the deployment of {plan.name!r}: {e}") from e
    url = _url(connection, port, plan.name)
    deployment = _deployment(plan, serve_config([app], host, port), url, connection)
    if wait:
        _wait_ready(client, deployment, timeout or settings.DEPLOY_TIMEOUT_S.get())
    return deployment


def plan_from(
    config: str | Path | DeployCheckpointsConfig | None,
    *,
    job_id: str | None = None,
    checkpoints: list[str] | None = None,
    model_name: str | None = None,
    engine: str = "auto",
    storage_root: str | None = None,
) -> DeploymentPlan:
    """What would be deployed: the config merged with the arguments, checkpoints read."""
    if config is None:
        cfg = DeployCheckpointsConfig()
    elif isinstance(config, DeployCheckpointsConfig):
        cfg = config
    else:
        cfg = load_deploy_config(config)
    if model_name:
        cfg = cfg.model_copy(update={"model_name": model_name})
    details = cfg.checkpoint_details
    if details and details.loops_checkpoint_ids:
        raise ConfigError("loops checkpoints are Baseten's own; they cannot be served here")
    listed: dict[str, list[Manifest]] = {}  # each job's checkpoints, read once
    if details and details.checkpoints:
        chosen = []
        for ckpt in details.checkpoints:
            job = get_job(ckpt.training_job_id, storage_root=storage_root)
            available = listed.setdefault(job.id, servable(job))
            (manifest,) = _named(job, available, [ckpt.checkpoint_name])
            chosen.append(_chosen(job, manifest, ckpt.model_weight_format))
    else:
        job = (
            get_job(job_id, storage_root=storage_root)
            if job_id
            else latest_job(storage_root=storage_root)
        )
        available = listed.setdefault(job.id, servable(job))
        chosen = [_chosen(job, m) for m in pick_checkpoints(job, checkpoints, available)]
    fulls = [m for found in listed.values() for m in found if m.checkpoint_type == "full"]
    return plan_deployment(cfg, chosen, engine=engine, full_checkpoints=fulls)


def servable(job: JobHandle) -> list[Manifest]:
    """The job's complete checkpoints, one per name (rank 0's, else the lowest rank's), newest
    first: what the wizard lists (a trainer's books kept at the top are no model)."""
    by_name: dict[str, Manifest] = {}
    for m in sorted(job.checkpoints(), key=lambda m: m.node_rank, reverse=True):
        if m.complete and not m.bookkeeping:
            by_name[m.name] = m
    return sorted(by_name.values(), key=lambda m: m.created_at, reverse=True)


def pick_checkpoints(
    job: JobHandle, names: list[str] | None, available: list[Manifest] | None = None
) -> list[Manifest]:
    """`names` (`latest`: the newest) among the job's servable checkpoints; none named: the one
    there is, an error naming them if there are several."""
    available = servable(job) if available is None else available
    if not available:
        raise ConfigError(f"job {job.id} has no complete checkpoint to deploy")
    if not names:
        if len(available) == 1:
            return available
        raise ConfigError(
            f"job {job.id} has {len(available)} checkpoints: choose with --checkpoint NAME "
            f"(or 'latest'): {', '.join(m.name for m in available)}"
        )
    return _named(job, available, names)


def _named(job: JobHandle, available: list[Manifest], names: list[str]) -> list[Manifest]:
    by_name = {m.name: m for m in available}
    picked = []
    for name in names:
        if name == "latest" and available:
            picked.append(available[0])
        elif name in by_name:
            picked.append(by_name[name])
        else:
            raise ConfigError(
                f"job {job.id} has no complete checkpoint named {name!r}; it has: "
                f"{', '.join(by_name) or 'none'}"
            )
    return list({m.name: m for m in picked}.values())


def list_deployments(
    *, address: str | None = None, connection: Connection | None = None
) -> list[Deployment]:
    """The deployments orchestrator made that Serve runs on the cluster, by name."""
    connection = connection or connect(address)
    details = _details(_serve_client(connection))
    port = int((details.get("http_options") or {}).get("port") or settings.SERVE_PORT.get())
    found = []
    for name, app in sorted(_applications(details).items()):
        config = app.get("deployed_app_config") or {}
        if config.get("import_path") not in _OURS:
            continue
        model = ServedModel.model_validate(config["args"]["model"])
        replicas = _running_replicas(app)
        status, message = app.get("status", ""), _message(app)
        found.append(Deployment(
            name=name, url=_url(connection, port, name), model_ids=model.model_ids(),
            engine=model.engine, checkpoints=[c.key for c in model.checkpoints],
            status=status, message=message, cause=_failure(status, message), replicas=replicas,
            serve_config=config, _connection=connection,
        ))  # fmt: skip
    return found


def get_deployment(
    name: str, *, address: str | None = None, connection: Connection | None = None
) -> Deployment:
    for d in list_deployments(address=address, connection=connection):
        if d.name == name:
            return d
    raise DeployError(f"no deployment named {name!r} (see `orchestrator deployments list`)")


def stop_deployment(
    name: str,
    *,
    address: str | None = None,
    connection: Connection | None = None,
    storage_root: str | None = None,
) -> None:
    """Delete the Serve application; Serve itself too when nothing else runs on it, so no
    controller, proxy or placement group is left behind."""
    with audited(storage(storage_root), "deployment stop", target=name):
        _stop_deployment(name, connection or connect(address))


def _stop_deployment(name: str, connection: Connection) -> None:
    client = _serve_client(connection)
    with serve_applications_lock(connection.address):  # read, drop ours, write back
        details = _details(client)
        running = _applications(details)
        config = (running.get(name) or {}).get("deployed_app_config") or {}
        if config.get("import_path") not in _OURS:
            raise DeployError(f"no deployment named {name!r} (see `orchestrator deployments list`)")
        rest = [a["deployed_app_config"] for n, a in running.items() if n != name]
        if not rest:
            client.delete_applications()
        else:
            host, port = _http_options(details, connection)
            client.deploy_applications(serve_config(rest, host, port))
    deadline = time.monotonic() + 120
    while name in _applications(_details(client)):
        if time.monotonic() > deadline:
            raise DeployError(f"deployment {name!r} was asked to stop but is still there")
        time.sleep(_POLL_S)


# -- Serve's REST API -----------------------------------------------------------------------


def _serve_client(connection: Connection) -> Any:
    connection.client()  # the environment a client of this cluster needs
    from orchestrator import ray_private

    return ray_private.serve_submission_client(connection.address)


def _details(client: Any) -> dict[str, Any]:
    try:
        return client.get_serve_details()
    except Exception as e:
        raise DeployError(f"could not read Ray Serve's state from the dashboard: {e}") from e


def _applications(details: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(details.get("applications") or {})


def _running_replicas(app: dict[str, Any]) -> int:
    deployments = (app.get("deployments") or {}).values()
    return sum(1 for d in deployments for r in d.get("replicas") or [] if r["state"] == "RUNNING")


def _http_options(details: dict[str, Any], connection: Connection) -> tuple[str, int]:
    """Serve's own when it runs (it keeps them), else ours."""
    running = details.get("http_options") or {}
    if details.get("controller_info", {}).get("node_id") and running.get("port"):
        return str(running["host"]), int(running["port"])
    default_host = "127.0.0.1" if connection.embedded else "0.0.0.0"
    return settings.SERVE_HOST.get() or default_host, settings.SERVE_PORT.get()


def _url(connection: Connection, port: int, name: str) -> str:
    host = urlsplit(connection.address).hostname or "127.0.0.1"
    return f"http://{host}:{port}/{name}/v1"


def _deployment(
    plan: DeploymentPlan, config: dict[str, Any], url: str, connection: Connection | None
) -> Deployment:
    model = plan.model
    return Deployment(
        name=model.name, url=url, model_ids=model.model_ids(), engine=model.engine,
        checkpoints=[c.key for c in model.checkpoints], engine_reason=plan.engine_reason,
        serve_config=config, _connection=connection,
    )  # fmt: skip


def _wait_ready(client: Any, deployment: Deployment, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        app = _applications(_details(client)).get(deployment.name) or {}
        deployment.status, deployment.message = app.get("status", ""), _message(app)
        deployment.cause = _failure(deployment.status, deployment.message)
        if deployment.status == "RUNNING":  # its replicas' engines answered their warm-up
            deployment.replicas = _running_replicas(app)
            return
        if deployment.cause:
            raise DeployError(
                f"deployment {deployment.name!r} is {deployment.status}: {deployment.cause} "
                f"(it stays listed until `orchestrator deployments stop {deployment.name}`)"
            )
        if time.monotonic() > deadline:
            said = f"; Serve says: {_cause(deployment.message)}" if deployment.message else ""
            raise DeployError(
                f"deployment {deployment.name!r} is not ready after {timeout:.0f} s "
                f"({deployment.status or 'not started'}{said}); it is left running: see "
                "`orchestrator deployments list` and the dashboard's Serve page"
            )
        time.sleep(_POLL_S)


def _message(app: dict[str, Any]) -> str:
    """The application's message, with its deployments' (where a replica's error is)."""
    parts = [app.get("message") or ""]
    for d in (app.get("deployments") or {}).values():
        if d.get("message"):
            parts.append(str(d["message"]))
    return "\n".join(p for p in parts if p)


def _failure(status: str, message: str) -> str:
    """Why the application failed, in one line; "" if it did not."""
    return _cause(message) if status in _FAILED else ""


def _cause(message: str) -> str:
    """The error at the end of a replica's traceback, without its module path."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "Serve gave no reason"
    name, sep, rest = lines[-1].partition(": ")
    return f"{name.rsplit('.', 1)[-1]}: {rest}" if sep and " " not in name else lines[-1]


def _chosen(job: JobHandle, manifest: Manifest, requested: Any = None) -> Chosen:
    adapter = None
    if any(f.path == "adapter_config.json" for f in manifest.files):
        adapter = json.loads(job.checkpoint_file(manifest, "adapter_config.json"))
    return Chosen(manifest=manifest, job=job.record, adapter_config=adapter,
                  requested_format=requested)  # fmt: skip
