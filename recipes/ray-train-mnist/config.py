"""Ray Train's PyTorch quickstart on CPU: TorchTrainer with 2 gloo workers on 2 nodes, resumable.

Run it with `orchestrator push recipes/ray-train-mnist/config.py --tail`; the job's rank 0 runs
`train.py` as Ray Train's driver and Train's workers run one per node, in the job's own nodes.
"""

from orchestrator import definitions

project = definitions.TrainingProject(
    name="ray-train-mnist",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"),
        compute=definitions.Compute(node_count=2, cpu_count=1, memory="2Gi"),
        runtime=definitions.Runtime(
            start_commands=["python train.py"],
            environment_variables={
                "OMP_NUM_THREADS": "1",
                # Train's controller polls its workers this often; a report waits for the next
                # poll, so a short interval lets an epoch of a fraction of a second report.
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
            },
            checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        ),
        ray_train=definitions.RayTrain(workers_per_node=1),
    ),
)
