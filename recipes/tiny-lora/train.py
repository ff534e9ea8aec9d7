"""Fine-tune the tiny LM from `tiny_lm.py` on CPU, fully and with LoRA, writing checkpoints.

Writes into $BT_CHECKPOINT_DIR (default ./checkpoints):
  checkpoint-0        the random base model + tokenizer (the starting point)
  checkpoint-<N>      the base fully fine-tuned for N steps
  lora-checkpoint-<N> a LoRA adapter (r=8) trained on checkpoint-0, which its
                      adapter_config.json names by absolute path; and the same adapter
                      half-way, lora-checkpoint-<N/2>
Each is written to a hidden temp directory and renamed into place, so an uploader
never sees a half-written checkpoint. Exits 1 if fine-tuning left greedy output unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_lm

PROMPT = "the cat"
LORA_RANK = 8


def save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    """Write model + tokenizer to `.tmp-<name>` and rename it, so `dest` is always complete."""
    if dest.exists():  # a retried attempt: the same deterministic result is already there
        print(f"{dest.name} already exists, keeping it", flush=True)
        return
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed attempt
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    adapter_config = tmp / "adapter_config.json"
    if adapter_config.exists():  # PEFT records the load path already; this pins it regardless
        cfg = json.loads(adapter_config.read_text())
        cfg["base_model_name_or_path"] = str(dest.parent / "checkpoint-0")
        adapter_config.write_text(json.dumps(cfg, indent=2))
    os.rename(tmp, dest)
    print(f"saved {dest}", flush=True)


def train(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int, lr: float, tag: str,
    after: dict[int, Callable[[], None]] | None = None,
) -> None:
    """Causal-LM loss on the whole batch each step (pad positions are masked out); `after[n]`
    runs after step n (a checkpoint mid-way)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    for step in range(1, steps + 1):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 1 or step % 5 == 0 or step == steps:
            print(f"[{tag}] step {step}/{steps} loss {loss.item():.4f}", flush=True)
        if after and step in after:
            after[step]()
    model.eval()


def greedy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    """The greedy continuation of PROMPT (new tokens only)."""
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps for each fine-tune")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW lr (full fine-tune)")
    parser.add_argument("--lora-lr", type=float, default=3e-2, help="AdamW lr (LoRA)")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()  # "Loading weights" bars would flood the job's log
    # peft 0.21 still calls a transformers 5 deprecated property; the warning is noise here.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # preempted: temp dirs are hidden
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ckpt_dir = Path(os.environ.get("BT_CHECKPOINT_DIR") or "./checkpoints").resolve()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    base_dir = ckpt_dir / "checkpoint-0"
    started = time.monotonic()

    # a. The base model; a retried attempt reloads the (identical) saved one.
    if base_dir.exists():
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        print(f"loaded base from {base_dir}", flush=True)
    else:
        tokenizer = tiny_lm.build_tokenizer()
        save(tiny_lm.build_model(tokenizer, seed=0), tokenizer, base_dir)
    # tokenizer.pad, not padding=True: that would be saved into the later tokenizer.json files.
    encoded = tokenizer([t + tokenizer.eos_token for t in tiny_lm.TRAIN_TEXTS])
    batch = dict(tokenizer.pad(encoded, return_tensors="pt"))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    # b. Full fine-tune of a fresh copy of the base.
    full = LlamaForCausalLM.from_pretrained(base_dir)
    train(full, batch, args.steps, args.lr, "full")
    save(full, tokenizer, ckpt_dir / f"checkpoint-{args.steps}")

    # c. LoRA on the base loaded by absolute path, which PEFT records as base_model_name_or_path.
    lora_cfg = LoraConfig(
        r=LORA_RANK,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(0)  # LoRA A is random: seed it so a retried attempt writes the same adapter
    lora = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), lora_cfg)
    half = args.steps // 2  # a second adapter, half-trained: deployments serve several at once
    midway = {half: lambda: save(lora, tokenizer, ckpt_dir / f"lora-checkpoint-{half}")}
    train(lora, batch, args.steps, args.lora_lr, "lora", after=midway if half else None)
    lora_dir = ckpt_dir / f"lora-checkpoint-{args.steps}"
    save(lora, tokenizer, lora_dir)
    adapter_cfg = json.loads((lora_dir / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(base_dir), adapter_cfg
    assert adapter_cfg["r"] == LORA_RANK, adapter_cfg

    # d. Show (and check) that both fine-tunes changed the greedy output.
    base = LlamaForCausalLM.from_pretrained(base_dir).eval()
    models = {"base": base, "full": full, "lora": lora}
    outputs = {name: greedy(model, tokenizer) for name, model in models.items()}
    for name, text in outputs.items():
        print(f"greedy {name:4s} {PROMPT!r} -> {text!r}", flush=True)
    print(f"done in {time.monotonic() - started:.1f}s", flush=True)
    unchanged = [name for name in ("full", "lora") if outputs[name] == outputs["base"]]
    if unchanged:
        print(f"error: greedy output of {', '.join(unchanged)} equals the base's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
