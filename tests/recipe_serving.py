"""What the deploy tests share (tests/test_deploy.py, the vLLM lane): the tiny-lora recipe
trained on the embedded cluster with its checkpoints downloaded, and the oracle, the weights
loaded directly with transformers (and peft)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from orchestrator.client.api import push
from orchestrator.client.deploy import list_deployments
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-lora"


@contextlib.contextmanager
def trained_recipe(storage_root: str, local: Path) -> Iterator[JobHandle]:
    """The recipe's job, COMPLETED, its checkpoints in `local/<name>`; Serve on a port of its
    own meanwhile, and every deployment stopped at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["ORCHESTRATOR_SERVE_PORT"] = str(s.getsockname()[1])
    try:
        job = push(RECIPE / "config.py", storage_root=storage_root)
        assert job.wait(timeout=300) == JobState.COMPLETED, job.logs()[-20:]
        for m in job.checkpoints():
            job.download_checkpoint(m, local / m.name)
        yield job
    finally:
        for d in list_deployments():
            d.stop()
        os.environ.pop("ORCHESTRATOR_SERVE_PORT", None)


def greedy(model_dir: Path, prompt: str, max_tokens: int, adapter: Path | None = None) -> str:
    """What the weights give loaded directly, in float32: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
