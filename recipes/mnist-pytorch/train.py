"""Train a small MLP on scikit-learn's bundled handwritten digits (no download needed).

Follows Baseten Training conventions:

* ``BT_CHECKPOINT_DIR``: if set, checkpoints are written there as ``checkpoint-<epoch>/``
  directories holding ``model.pt`` (state_dict), ``optimizer.pt`` and ``meta.json``.
* ``BT_LOAD_CHECKPOINT_DIR``: if set, the newest checkpoint found under
  ``rank-<n>/<checkpoint_name>/model.pt`` is loaded and training continues after its epoch.
* Retries: a newest ``checkpoint-<N>/`` already in ``BT_CHECKPOINT_DIR`` (this job's own
  progress, put back there for a retried attempt, ``BT_RETRY_COUNT`` > 0) wins over
  ``BT_LOAD_CHECKPOINT_DIR``: the run continues after epoch N.
* SIGTERM (a stop or preemption): the current epoch is finished, checkpointed if it is not
  yet, and the script exits with status 143.

Exits with status 1 if the final test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import torch
from torch import nn

_T0 = time.perf_counter()

CHECKPOINT_PREFIX = "checkpoint-"
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143, what a process killed by SIGTERM reports
TEST_FRACTION = 0.25
SPLIT_SEED = 1234  # fixed so the held-out split never changes between runs or resumes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20, help="total epochs (default: 20)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default: 5e-3)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default: 32)")
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
    """Use ``OMP_NUM_THREADS`` if set to a positive int, else ``min(2, cpu_count)``."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    n = int(env) if env.isdigit() and int(env) > 0 else min(2, os.cpu_count() or 1)
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
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    gen: torch.Generator,
) -> float:
    """Run one shuffled epoch; return the mean training loss."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.randperm(len(x), generator=gen)
    total = 0.0
    for i in range(0, len(x), batch_size):
        idx = perm[i : i + batch_size]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += loss.item() * len(idx)
    return total / len(x)


def _checkpoint_number(path: Path) -> int | None:
    """Return the trailing number in a checkpoint directory name, or None."""
    m = re.search(r"(\d+)$", path.name)
    return int(m.group(1)) if m else None


def save_checkpoint(
    root: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int, accuracy: float
) -> Path:
    """Atomically write ``root/checkpoint-<epoch>/`` (temp dir in ``root``, then rename)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{epoch}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        meta = {"epoch": epoch, "accuracy": accuracy}
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


def find_resume_checkpoint(load_dir: Path, preferred_rank: int) -> Path | None:
    """Find the checkpoint with the highest number under ``load_dir/rank-<n>/<name>/``.

    Ties between ranks go to ``preferred_rank``, then to the lowest rank. Checkpoint
    directories placed directly in ``load_dir`` (no ``rank-<n>`` level) are accepted too.
    """
    candidates: list[tuple[int, int, int, Path]] = []  # (number, preferred?, -rank, path)
    if not load_dir.is_dir():
        return None
    for child in load_dir.iterdir():
        m = re.fullmatch(r"rank-(\d+)", child.name)
        if m and child.is_dir():
            rank, ckpt_dirs = int(m.group(1)), list(child.iterdir())
        else:
            rank, ckpt_dirs = preferred_rank, [child]
        for ckpt in ckpt_dirs:
            num = _checkpoint_number(ckpt)
            if num is not None and (ckpt / "model.pt").is_file():
                candidates.append((num, rank == preferred_rank, -rank, ckpt))
    return max(candidates, key=lambda c: c[:3])[3] if candidates else None


def find_own_checkpoint(root: Path) -> Path | None:
    """The newest complete ``checkpoint-<N>/`` directly in ``root`` (holding model.pt), or None.

    Only exact ``checkpoint-<N>`` names count: hidden ``.tmp-*`` / ``.old-*`` directories left
    by an interrupted save are never taken.
    """
    if not root.is_dir():
        return None
    found: list[tuple[int, Path]] = []
    for child in root.iterdir():
        m = re.fullmatch(re.escape(CHECKPOINT_PREFIX) + r"(\d+)", child.name)
        if m and child.is_dir() and (child / "model.pt").is_file():
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load weights (and optimizer state if present) from ``path``; return its epoch."""
    model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
    if (path / "optimizer.pt").is_file():
        opt.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu"))
    meta_file = path / "meta.json"
    if meta_file.is_file():
        return int(json.loads(meta_file.read_text())["epoch"])
    return _checkpoint_number(path) or 0


class StopRequest:
    """Set by SIGTERM; the training loop acts on it between epochs."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:  # os.write: print() may be mid-call in the interrupted frame
            os.write(sys.stdout.fileno(), b"SIGTERM received: stopping after this epoch\n")
        self.requested = True


def checkpoint_on_stop(
    root: Path | None,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    epoch: int,
    accuracy: float,
    saved_epoch: int | None,
) -> int:
    """On SIGTERM: checkpoint ``epoch`` unless it is saved (or nothing is); the exit status."""
    if root is None:
        what = "checkpointing is off (BT_CHECKPOINT_DIR unset)"
    elif epoch == 0:
        what = "no epoch finished, nothing to save"
    elif saved_epoch == epoch:
        what = f"checkpoint of epoch {epoch} already saved"
    else:
        what = f"saved checkpoint {save_checkpoint(root, model, opt, epoch, accuracy)}"
    print(f"SIGTERM: {what} ; exiting", flush=True)
    return SIGTERM_EXIT


def _env(name: str) -> str:
    """Return env var ``name`` or "-" when unset/empty."""
    return os.environ.get(name) or "-"


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint, and return the process exit code."""
    args = parse_args(argv)
    stop = StopRequest()
    stop.install()  # before the slow start-up, so an early SIGTERM is handled too
    threads = configure_threads()
    print(
        f"env: job_id={_env('BT_TRAINING_JOB_ID')} node_rank={_env('BT_NODE_RANK')} "
        f"group_size={_env('BT_GROUP_SIZE')} checkpoint_dir={_env('BT_CHECKPOINT_DIR')} "
        f"load_checkpoint_dir={_env('BT_LOAD_CHECKPOINT_DIR')} "
        f"retry_count={_env('BT_RETRY_COUNT')} threads={threads}",
        flush=True,
    )

    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data()
    print(f"data: {len(x_tr)} train / {len(x_te)} test samples", flush=True)
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt_env = os.environ.get("BT_CHECKPOINT_DIR")
    ckpt_root = Path(ckpt_env) if ckpt_env else None
    start_epoch = 0
    saved_epoch: int | None = None  # the newest epoch whose checkpoint is in ckpt_root
    load_dir = os.environ.get("BT_LOAD_CHECKPOINT_DIR")
    # This job's own newest checkpoint (a retried attempt finds it here) beats a loaded one.
    own = find_own_checkpoint(ckpt_root) if ckpt_root is not None else None
    if own is not None:
        start_epoch = saved_epoch = load_checkpoint(own, model, opt)
        print(
            f"resumed from {own} (epoch {start_epoch}, BT_RETRY_COUNT={_env('BT_RETRY_COUNT')})",
            flush=True,
        )
        if load_dir:
            print(f"BT_LOAD_CHECKPOINT_DIR not used: {own} is this job's own", flush=True)
    elif load_dir:
        rank_env = os.environ.get("BT_NODE_RANK", "0")
        rank = int(rank_env) if rank_env.isdigit() else 0
        ckpt = find_resume_checkpoint(Path(load_dir), rank)
        if ckpt is None:
            print(f"no checkpoint found in {load_dir}; starting from scratch", flush=True)
        else:
            start_epoch = load_checkpoint(ckpt, model, opt)
            print(f"resumed from {ckpt} (epoch {start_epoch})", flush=True)

    acc = evaluate(model, x_te, y_te)
    if stop.requested:  # SIGTERM during start-up
        return checkpoint_on_stop(ckpt_root, model, opt, start_epoch, acc, saved_epoch)
    for epoch in range(start_epoch + 1, args.epochs + 1):
        gen = torch.Generator().manual_seed(args.seed * 100_003 + epoch)  # resumable shuffle
        loss = train_epoch(model, opt, x_tr, y_tr, args.batch_size, gen)
        acc = evaluate(model, x_te, y_te)
        print(f"epoch {epoch}/{args.epochs} loss {loss:.4f} test_acc {acc:.4f}", flush=True)
        periodic = args.checkpoint_every > 0 and epoch % args.checkpoint_every == 0
        if ckpt_root is not None and (periodic or epoch == args.epochs):
            path = save_checkpoint(ckpt_root, model, opt, epoch, acc)
            saved_epoch = epoch
            print(f"saved checkpoint {path}", flush=True)
        if stop.requested:
            return checkpoint_on_stop(ckpt_root, model, opt, epoch, acc, saved_epoch)

    print(f"final test accuracy: {acc:.4f}", flush=True)
    print(f"elapsed: {time.perf_counter() - _T0:.1f}s (since torch import)", flush=True)
    if acc < args.min_accuracy:
        print(
            f"ERROR: final test accuracy {acc:.4f} is below --min-accuracy {args.min_accuracy:.4f}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
