"""Ray Train's PyTorch quickstart on CPU: the digits MLP, data-parallel over 2 gloo workers.

The script is Ray Train's driver: `ray.init()` joins the cluster in ``RAY_ADDRESS`` (the job's
own, when the orchestrator runs it with ``ray_train``) and ``TorchTrainer.fit()`` starts the
workers. Each worker trains on its shard of the training split (``prepare_data_loader``: a
``DistributedSampler``) and DDP averages the gradients (``prepare_model``).

* Every epoch every worker calls ``ray.train.report({"epoch", "loss", "accuracy"}, ...)``;
  rank 0 adds a checkpoint (``model.pt`` and ``optimizer.pt`` in a temporary directory).
* Resume: when ``ray.train.get_checkpoint()`` returns one (a retried job gets the newest whole
  checkpoint back), every worker loads it and training continues at the next epoch.

The driver prints ``final test accuracy: 0.9733`` and exits with status 1 below
``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TEST_FRACTION = 0.25
SPLIT_SEED = 1234  # the same held-out split as the mnist-pytorch recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=12, help="total epochs (default: 12)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default: 5e-3)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="global batch size, split evenly across workers (default: 32)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for init and shuffling (default: 0)")
    p.add_argument(
        "--num-workers",
        type=int,
        default=int(os.environ.get("ORCHESTRATOR_TRAIN_WORKERS", "2")),
        help="Ray Train workers (default: ORCHESTRATOR_TRAIN_WORKERS, else 2)",
    )
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.9,
        help="exit 1 if the final test accuracy is below this (default: 0.9)",
    )
    p.add_argument("--name", default="ray-train-mnist", help="the run's name (RunConfig)")
    p.add_argument(
        "--storage-path",
        default=None,
        help="where Train keeps the run (RunConfig; default ~/ray_results; a job's nodes use "
        "their $BT_CHECKPOINT_DIR whatever is set)",
    )
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size < 1 or args.num_workers < 1:
        p.error("--epochs must be >= 0, --batch-size and --num-workers >= 1")
    return args


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8x8 digits with a fixed train/test split: (x_tr, y_tr, x_te, y_te)."""
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
    """Classification accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def train_func(config: dict) -> None:
    """Ray Train's per-worker loop: train, report every epoch, checkpoint on rank 0."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    # Ray's node id: Train's own node rank groups workers by IP, one node on a simulated cluster
    print(
        f"worker {rank}/{world} running on node {ray.get_runtime_context().get_node_id()}",
        flush=True,
    )

    torch.manual_seed(config["seed"])  # the same initial weights on every worker
    x_tr, y_tr, x_te, y_te = load_data()
    loader = DataLoader(
        TensorDataset(x_tr, y_tr), batch_size=max(1, config["batch_size"] // world), shuffle=True
    )
    loader = ray.train.torch.prepare_data_loader(loader)  # a DistributedSampler per worker
    model = ray.train.torch.prepare_model(build_model())  # DDP when there are several workers
    net = model.module if hasattr(model, "module") else model
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"), map_location="cpu")
            net.load_state_dict(state["model"])
            opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt"), map_location="cpu"))
            start = state["epoch"] + 1
        print(f"worker {rank} resumes at epoch {start + 1}", flush=True)

    loss_fn = nn.CrossEntropyLoss()
    epochs = config["epochs"]
    for epoch in range(start, epochs):
        if world > 1:
            loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on resume
        model.train()
        totals = torch.zeros(2, dtype=torch.float64)  # (loss sum, samples)
        steps, t0 = 0, time.perf_counter()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            totals[0] += loss.detach() * len(yb)
            totals[1] += len(yb)
            steps += 1
        step_ms = (time.perf_counter() - t0) * 1000 / max(steps, 1)
        if world > 1:
            dist.all_reduce(totals)
        loss_value = (totals[0] / totals[1]).item()
        accuracy = evaluate(net, x_te, y_te)  # identical weights: each worker the whole split
        metrics = {"epoch": epoch + 1, "loss": loss_value, "accuracy": accuracy}
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{epochs} loss {loss_value:.4f} accuracy {accuracy:.4f} "
                f"step_ms {step_ms:.2f}",
                flush=True,
            )
        with tempfile.TemporaryDirectory() as tmp:
            saved = None
            if rank == 0:  # the model is the same on every worker: rank 0 saves it
                torch.save(
                    {"model": net.state_dict(), "epoch": epoch}, os.path.join(tmp, "model.pt")
                )
                torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
                saved = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=saved)

    if start >= epochs:  # resumed after the last epoch: report its accuracy once more
        accuracy = evaluate(net, x_te, y_te)
        ray.train.report({"epoch": epochs, "loss": float("nan"), "accuracy": accuracy})


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; return 1 if the final accuracy is below ``--min-accuracy``."""
    args = parse_args(argv)
    ray.init()  # RAY_ADDRESS: the cluster running this job
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "epochs": args.epochs,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "seed": args.seed,
        },
        torch_config=TorchConfig(backend="gloo"),
        # SPREAD: one worker a node when run bare, as the job places them (in its own group)
        scaling_config=ScalingConfig(
            num_workers=args.num_workers, use_gpu=False, placement_strategy="SPREAD"
        ),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path),
    )
    result = trainer.fit()
    accuracy = float((result.metrics or {}).get("accuracy", 0.0))
    print(f"final test accuracy: {accuracy:.4f}", flush=True)
    if result.checkpoint is not None:
        print(f"last checkpoint: {result.checkpoint.path}", flush=True)
    if accuracy < args.min_accuracy:
        print(
            f"ERROR: final test accuracy {accuracy:.4f} is below --min-accuracy "
            f"{args.min_accuracy:.4f}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
