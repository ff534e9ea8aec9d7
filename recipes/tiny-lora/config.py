"""A tiny LM fine-tuned on CPU (full and LoRA), ready for `orchestrator deploy_checkpoints`.

Run it with `orchestrator push recipes/tiny-lora/config.py --tail`.
"""

from orchestrator import definitions

project = definitions.TrainingProject(
    name="tiny-lora",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"),
        compute=definitions.Compute(cpu_count=2, memory="4Gi"),
        runtime=definitions.Runtime(
            start_commands=["/bin/sh -c 'chmod +x ./run.sh && ./run.sh'"],
            environment_variables={"OMP_NUM_THREADS": "2"},
            checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        ),
    ),
)
