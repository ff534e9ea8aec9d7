"""Data-parallel training of a small MLP on scikit-learn's digits, launched by torchrun.

Every process is one rank: torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. The backend is ``nccl`` (device ``cuda:LOCAL_RANK``)
when CUDA is available, else ``gloo`` on CPU. Each rank trains on its own shard of the
training split (``DistributedSampler``); ``DistributedDataParallel`` averages the gradients.

* ``BT_CHECKPOINT_DIR``: if set, rank 0 writes ``checkpoint-<epoch>/`` directories holding
  ``model.pt`` (state_dict) and ``meta.json`` there.

Every rank exits with status 1 if the final test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

_T0 = time.perf_counter()

CHECKPOINT_PREFIX = "checkpoint-"
TEST_FRACTION = 0.25
SPLIT_SEED = 1234  # the same held-out split as the mnist-pytorch recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20, help="total epochs (default: 20)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default: 5e-3)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="global batch size, split evenly across ranks (default: 32)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for init and shuffling (default: 0)")
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.9,
        help="exit 1 if final test accuracy is below this (default: 0.9)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="checkpoint every N epochs when BT_CHECKPOINT_DIR is set; the last epoch is "
        "always saved; 0 = last epoch only (default: 5)",
    )
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or args.checkpoint_every < 0:
        p.error("--epochs and --checkpoint-every must be >= 0, --batch-size >= 1")
    return args


def configure_threads() -> int:
    """Use ``OMP_NUM_THREADS`` if set to a positive int, else 1 (one thread per rank)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    n = int(env) if env.isdigit() and int(env) > 0 else 1
    torch.set_num_threads(n)
    return n


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load the 8x8 digits and return a fixed train/test split as (x_tr, y_tr, x_te, y_te)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def build_model() -> nn.Module:
    """A small MLP: 64 -> 128 -> 64 -> 10."""
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Return classification accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def train_epoch(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: DataLoader,
    device: torch.device,
) -> float:
    """Run one epoch over this rank's shard; return the mean training loss over all ranks."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, sample count)
    for xb, yb in loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        totals[0] += loss.detach() * len(yb)
        totals[1] += len(yb)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def save_checkpoint(root: Path, model: nn.Module, epoch: int, accuracy: float) -> Path:
    """Atomically write ``root/checkpoint-<epoch>/`` (temp dir in ``root``, then rename)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{epoch}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        torch.save(model.state_dict(), tmp / "model.pt")
        meta = {"epoch": epoch, "accuracy": accuracy, "world_size": dist.get_world_size()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        old = None
        if final.exists():  # e.g. a re-run over the same dir: swap the old one out first
            old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=root))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up; return (rank, world_size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _env(*names: str) -> str:
    """Return the first of the env vars ``names`` that is set, or "-"."""
    return next((os.environ[n] for n in names if os.environ.get(n)), "-")


def main(argv: list[str] | None = None) -> int:
    """Train on every rank, checkpoint on rank 0, and return the same exit code on all ranks."""
    args = parse_args(argv)
    threads = configure_threads()
    rank, world_size, device = setup_distributed()
    is_leader = rank == 0
    print(
        f"rank {rank}/{world_size}: node_rank={_env('NODE_RANK', 'BT_NODE_RANK', 'GROUP_RANK')} "
        f"local_rank={_env('LOCAL_RANK')} backend={dist.get_backend()} device={device} "
        f"master={_env('MASTER_ADDR')}:{_env('MASTER_PORT')} threads={threads} "
        f"CUDA_VISIBLE_DEVICES={_env('CUDA_VISIBLE_DEVICES')}"
        + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        flush=True,
    )

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts)
    x_tr, y_tr, x_te, y_te = load_data()
    x_te, y_te = x_te.to(device), y_te.to(device)
    per_rank_batch = max(1, args.batch_size // world_size)
    sampler = DistributedSampler(
        TensorDataset(x_tr, y_tr), num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(sampler.dataset, batch_size=per_rank_batch, sampler=sampler)
    if is_leader:
        print(
            f"data: {len(x_tr)} train / {len(x_te)} test samples; {len(sampler)} per rank, "
            f"batch {per_rank_batch} per rank ({per_rank_batch * world_size} global)",
            flush=True,
        )

    model = DistributedDataParallel(
        build_model().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt_env = os.environ.get("BT_CHECKPOINT_DIR")
    ckpt_root = Path(ckpt_env) if ckpt_env and is_leader else None
    acc = evaluate(model.module, x_te, y_te)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        loss = train_epoch(model, opt, loader, device)
        # Weights are identical on every rank, so each evaluates the full (small) test split.
        acc = evaluate(model.module, x_te, y_te)
        if is_leader:
            print(f"epoch {epoch}/{args.epochs} loss {loss:.4f} test_acc {acc:.4f}", flush=True)
        periodic = args.checkpoint_every > 0 and epoch % args.checkpoint_every == 0
        if ckpt_root is not None and (periodic or epoch == args.epochs):
            path = save_checkpoint(ckpt_root, model.module, epoch, acc)
            print(f"saved checkpoint {path}", flush=True)

    # Rank 0's verdict decides every rank's exit code, so no node succeeds while another fails.
    verdict = torch.tensor([acc], dtype=torch.float64, device=device)
    dist.broadcast(verdict, src=0)
    acc = verdict.item()
    # Drop DDP (its reducer holds gloo work) before the group goes: work still alive at
    # interpreter exit can abort a finished run ("terminate called without an active exception").
    del model, opt
    dist.destroy_process_group()

    if is_leader:
        print(f"final test accuracy: {acc:.4f}", flush=True)
        print(f"elapsed: {time.perf_counter() - _T0:.1f}s (since torch import)", flush=True)
    if acc < args.min_accuracy:
        print(
            f"ERROR: rank {rank}: final test accuracy {acc:.4f} is below "
            f"--min-accuracy {args.min_accuracy:.4f}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
