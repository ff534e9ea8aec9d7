"""`orchestrator deploy_checkpoints`: serve a job's checkpoints; asks for what is missing, like
Baseten's wizard, unless --non-interactive (or no terminal), where a missing value is an error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.prompt import Prompt
from rich.table import Table

from orchestrator.cli.options import Address, JobId, StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.api import get_job, latest_job
from orchestrator.client.config_loader import load_deploy_config
from orchestrator.client.deploy import deploy_plan, plan_from, servable
from orchestrator.client.jobs import JobHandle
from orchestrator.errors import ConfigError
from orchestrator.serving.plan import renamed
from orchestrator.spec.deploy import CheckpointList, DeployCheckpointsConfig
from orchestrator.spec.training import Compute

_stderr = Console(stderr=True, highlight=False)


def deploy_checkpoints(
    job_id: JobId = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="A deploy.py defining a DeployCheckpointsConfig")
    ] = None,
    checkpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--checkpoint",
            help="A checkpoint of the job to serve ('latest' for the "
            "newest); repeat for several LoRA adapters",
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="Default: the base model's last segment")
    ] = None,
    base_model: Annotated[
        str | None,
        typer.Option(
            "--base-model",
            help="The LoRA adapters' base model (a path, a storage URI "
            "or a Hugging Face id); default: what adapter_config.json says",
        ),
    ] = None,
    accelerator: Annotated[
        str | None,
        typer.Option("--accelerator", help="GPUs per replica, e.g. H100:1; default: CPU"),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine", help="auto (vllm with GPUs, else transformers), vllm, transformers"
        ),
    ] = "auto",
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace a running deployment of the same name")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the Serve config (for `serve deploy`); deploy nothing"
        ),
    ] = False,
    non_interactive: Annotated[
        bool, typer.Option("--non-interactive", help="Never prompt: a missing value is an error")
    ] = False,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds to wait for it to answer")
    ] = None,
    address: Address = None,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Serve checkpoints of a training job as an OpenAI-compatible endpoint (Ray Serve)."""
    interactive = not non_interactive and sys.stdin.isatty() and output is OutputFormat.text
    cfg = load_deploy_config(config) if config else DeployCheckpointsConfig()
    cfg = _with_flags(cfg, base_model, accelerator)
    names = checkpoint
    has_list = bool(cfg.checkpoint_details and cfg.checkpoint_details.checkpoints)
    if not has_list:
        job = get_job(job_id, storage_root=storage_root) if job_id else None
        if job is None:
            job = latest_job(storage_root=storage_root)
            _stderr.print(f"[dim]no --job-id given: using the most recent job, {job.id}[/dim]")
        job_id = job.id
        if not names and interactive:
            names = _ask_checkpoints(job)
    plan = plan_from(cfg, job_id=job_id, checkpoints=names, model_name=model_name,
                     engine=engine, storage_root=storage_root)  # fmt: skip
    if not (model_name or cfg.model_name) and interactive:
        plan = renamed(plan, Prompt.ask("Model name", default=plan.name, console=_stderr))
    _stderr.print(f"engine: [bold]{plan.model.engine}[/bold] ({escape(plan.engine_reason)})")
    deployment = deploy_plan(plan, replace=replace, dry_run=dry_run, timeout=timeout,
                             address=address, storage_root=storage_root)  # fmt: skip
    if dry_run:
        if output is OutputFormat.json:
            print_json(deployment.serve_config)
        else:
            print(yaml.safe_dump(deployment.serve_config, sort_keys=False), end="")
        return
    if output is OutputFormat.json:
        print_json(deployment.as_dict())
        return
    console.print(f"[green]deployed[/green] {escape(deployment.name)}: {deployment.url}")
    for model_id in deployment.model_ids:
        console.print(f"  model {escape(model_id)}")
    console.print(
        f"try: curl {deployment.url}/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{deployment.model_ids[0]}", "messages": '
        '[{"role": "user", "content": "Hello"}]}\'',
        markup=False,
    )


def _with_flags(
    cfg: DeployCheckpointsConfig, base_model: str | None, accelerator: str | None
) -> DeployCheckpointsConfig:
    update: dict = {}
    if base_model:
        details = cfg.checkpoint_details or CheckpointList()
        update["checkpoint_details"] = details.model_copy(update={"base_model_id": base_model})
    if accelerator:
        compute = cfg.compute or Compute()
        try:
            update["compute"] = Compute.model_validate(
                {**compute.model_dump(), "accelerator": accelerator}
            )
        except ValueError as e:
            raise ConfigError(f"--accelerator {accelerator!r}: {e}") from None
    return cfg.model_copy(update=update) if update else cfg


def _ask_checkpoints(job: JobHandle) -> list[str]:
    available = servable(job)
    if len(available) <= 1:
        return [m.name for m in available]
    table = Table(title=f"checkpoints of job {job.id} (latest first)")
    for column in ("#", "checkpoint", "type", "created"):
        table.add_column(column)
    for i, m in enumerate(available, 1):
        kind = f"lora (r={m.lora_rank})" if m.checkpoint_type == "lora" else m.checkpoint_type
        table.add_row(str(i), m.name, kind, when(m.created_at))
    _stderr.print(table)
    answer = Prompt.ask(
        "Checkpoints to deploy (numbers or names, comma-separated; several only for LoRA)",
        default="latest",
        console=_stderr,
    )
    picked = []
    for part in (p.strip() for p in answer.split(",") if p.strip()):
        if part.isdigit() and 1 <= int(part) <= len(available):
            picked.append(available[int(part) - 1].name)
        else:
            picked.append(part)
    return picked
