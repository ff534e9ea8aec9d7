"""Data-parallel training across 2 nodes with torchrun (gloo on CPU, nccl on GPUs).

Run it with `orchestrator push recipes/multinode-ddp/config.py --tail`, or on one machine
with `orchestrator push recipes/multinode-ddp/config.py --colocate-ranks --tail`.
"""

from orchestrator import definitions

project = definitions.TrainingProject(
    name="multinode-ddp",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"),
        compute=definitions.Compute(
            node_count=2,
            cpu_count=1,
            memory="2Gi",
            # For GPUs (one torchrun worker per GPU, nccl):
            # accelerator=definitions.AcceleratorSpec(accelerator="H100", count=8),
        ),
        runtime=definitions.Runtime(
            start_commands=["/bin/sh -c 'chmod +x ./run.sh && ./run.sh'"],
            environment_variables={"OMP_NUM_THREADS": "1"},
            checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        ),
    ),
)
