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
    with serve_port_of_its_own():
        job = push(RECIPE / "config.py", storage_root=storage_root)
        assert job.wait(timeout=300) == JobState.COMPLETED, job.logs()[-20:]
        for m in job.checkpoints():
            job.download_checkpoint(m, local / m.name)
        yield job


@contextlib.contextmanager
def serve_port_of_its_own() -> Iterator[None]:
    """Serve on a free port meanwhile (never a developer's 8000), every deployment stopped at
    the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["ORCHESTRATOR_SERVE_PORT"] = str(s.getsockname()[1])
    try:
        yield
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


# Checkpoints that an engine cannot run, written by a job of their own (random weights, the
# recipe's tokenizer, built offline in a second):
#   headdim16-checkpoint-1  a GPT-2 with n_embd=32, n_head=2 (head_dim 16): transformers serves
#                           it; vLLM's CPU build starts, then dies at the first request
#   noarch-checkpoint-1     a config.json whose model_type no library knows
#   mismatch-checkpoint-1   a Llama whose config.json says hidden_size 128, its weights 64
#   heads-checkpoint-1      a Llama of 2 attention heads and 3 key-value heads: transformers
#                           loads it, and its attention fails at the first token
#   healthy-checkpoint-1    the recipe's tiny Llama (head_dim 32), as it is
BROKEN_WRITER = f"""
import json, os, pathlib, shutil, sys
sys.path.insert(0, {str(RECIPE)!r})
import tiny_lm
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

root = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
tokenizer = tiny_lm.build_tokenizer()


def save(model, name, patch=None):
    tmp, dest = root / f".tmp-{{name}}", root / name
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if patch:
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({{**config, **patch}}))
    os.rename(tmp, dest)


gpt2 = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_head=2, n_layer=2, n_positions=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
save(GPT2LMHeadModel(gpt2), "headdim16-checkpoint-1")
save(tiny_lm.build_model(tokenizer), "noarch-checkpoint-1",
     {{"model_type": "no-such-arch", "architectures": ["NoSuchArchForCausalLM"]}})
save(tiny_lm.build_model(tokenizer), "mismatch-checkpoint-1", {{"hidden_size": 128}})
heads = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=3,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
save(LlamaForCausalLM(heads), "heads-checkpoint-1")
save(tiny_lm.build_model(tokenizer), "healthy-checkpoint-1")
"""
BROKEN_CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="broken-models",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="2Gi"),
        runtime=d.Runtime(
            start_commands=["python write.py"],
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
    ),
)
"""


def broken_checkpoints(storage_root: str, directory: Path) -> JobHandle:
    """The job that wrote the checkpoints above, COMPLETED."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "write.py").write_text(BROKEN_WRITER)
    (directory / "config.py").write_text(BROKEN_CONFIG)
    job = push(directory / "config.py", storage_root=storage_root)
    assert job.wait(timeout=300) == JobState.COMPLETED, job.logs()[-20:]
    return job
