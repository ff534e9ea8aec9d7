"""A starter training job. Edit it, then: orchestrator push config.py --tail"""

from orchestrator import definitions

project = definitions.TrainingProject(
    name="my-training-project",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"),
        compute=definitions.Compute(
            node_count=1,
            cpu_count=2,
            memory="4Gi",
            # accelerator=definitions.AcceleratorSpec(accelerator="H100", count=8),
        ),
        runtime=definitions.Runtime(
            start_commands=["/bin/sh -c 'chmod +x ./run.sh && ./run.sh'"],
            environment_variables={
                "EXAMPLE_SETTING": "1",
                # "HF_TOKEN": definitions.SecretReference(name="hf_access_token"),
            },
            checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        ),
    ),
)
