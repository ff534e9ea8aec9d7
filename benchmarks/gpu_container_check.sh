#!/usr/bin/env bash
# Jobs in containers on a real GPU (ORCHESTRATOR_JOB_RUNTIME=container), on a node without CDI:
# what node/gpus.py gives a rank's container there (the device nodes, the driver's libraries and
# nvidia-smi bound read-only under /usr/local/nvidia).
#
# 1. benchmarks/gpu/container_devices.py: nvidia-smi and a CUDA kernel in a minimal image (no
#    CUDA library of its own) with what gpu_access gives, then without the devices and without
#    the driver's files, each of which must fail;
# 2. recipes/multinode-ddp on one node with accelerator H100:1, through the CLI and the embedded
#    local Ray, in an image built here from this machine's Python and CUDA torch (tests/images.py;
#    no Ray in it): nccl on cuda:0 inside the container, its checkpoints uploaded; then a command
#    in the held job's container (`orchestrator shell -- CMD`).
#
# Usage: benchmarks/gpu_container_check.sh [BUNDLE_DIR] [WHEEL_DIR]   (results under $OUT)
# BUNDLE_DIR: podroot.tar.xz, made by benchmarks/podman_bundle.sh (the device machine has no
# podman and no package registry); it also holds a static busybox and the CUDA program.
# WHEEL_DIR: as for gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-container-check}"
mkdir -p "$out"
bundle="${1:-.gpu}"
wheels="${2:-.whl}"
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
orch() { python3 -c 'import sys; from orchestrator.cli.app import main; sys.argv[0] = "orchestrator"; main()' "$@"; }

step "setup"
tar -C /tmp -xJf "$bundle/podroot.tar.xz" && . /tmp/podroot/env.sh || exit 1
[ -x /bin/busybox ] || install -m 755 /tmp/podroot/busybox /bin/busybox
if ! podman info >/dev/null 2>&1; then  # no overlay on this file system: podman's copying driver
  sed -i 's/^driver = .*/driver = "vfs"/' /etc/containers/storage.conf
fi
podman info --format 'podman {{.Version.Version}}, {{.Store.GraphDriverName}}, cgroups {{.Host.CgroupsVersion}} ({{.Host.CgroupManager}}), {{.Host.OCIRuntime.Name}}' || exit 1
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
fi
export PYTHONUNBUFFERED=1

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ls -l /dev/nvidia* | awk '{print $1, $5, $6, $NF}'
ls /etc/cdi /var/run/cdi 2>&1 | tr '\n' ' '; echo
ldconfig -p | grep -E "libcuda\.so|libnvidia-ml\.so" ; command -v nvidia-smi

if [ -z "${GPU_CHECK_SKIP_1:-}" ]; then  # GPU_CHECK_SKIP_1=1: step 2 alone
  step "1. a CUDA kernel in a minimal image, with and without what gpu_access gives"
  python3 benchmarks/gpu/container_devices.py /tmp/podroot/vector_add 2>&1 | tee "$out/devices.log"
fi

step "2. multinode-ddp on ${GPU_CHECK_ACCELERATOR-H100:1} in a container of this machine's Python and torch"
start=$(date +%s)
image=$(python3 -c 'from tests import images; print(images.python_image())') || exit 1
echo "image $image built in $(( $(date +%s) - start )) s"
podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.1f GB\n", $1 / 1e9}'
podman run --rm --network host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 "$image" python3 -c 'import torch; print("torch", torch.__version__, "in the image")' || exit 1
job=/tmp/ddp-container
mkdir -p "$job" && cp recipes/multinode-ddp/run.sh recipes/multinode-ddp/train.py "$job"/
# The image has no torchrun script (tests/images.py copies packages, not a venv's bin/).
printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' > "$job/torchrun"
# GPU_CHECK_ACCELERATOR= (empty) tries the script out on a machine without a GPU (gloo on CPU).
acc="${GPU_CHECK_ACCELERATOR-H100:1}"
accelerator=""
[ -n "$acc" ] && accelerator="accelerator=definitions.AcceleratorSpec(accelerator=\"${acc%:*}\", count=${acc#*:}),"
cat > "$job/config.py" <<EOF
from orchestrator import definitions

project = definitions.TrainingProject(
    name="ddp-container",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="$image"),
        compute=definitions.Compute(
            node_count=1, cpu_count=4, memory="16Gi",
            $accelerator
        ),
        runtime=definitions.Runtime(
            start_commands=["/bin/sh -c 'chmod +x run.sh torchrun && TORCHRUN=./torchrun ./run.sh --epochs 30'"],
            environment_variables={"OMP_NUM_THREADS": "1"},
            checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        ),
    ),
)
EOF
export ORCHESTRATOR_JOB_RUNTIME=container ORCHESTRATOR_SCHEDULING_TIMEOUT_S=60
start=$(date +%s%N)
orch push "$job/config.py" --tail 2>&1 | tee "$out/ddp-container.log" | grep -v "^\s*$" | tail -n 14
echo "exit ${PIPESTATUS[0]}; push -> end $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -m 3 -o "the commands run in a container.*\|backend=.*" "$out/ddp-container.log"
orch checkpoints list --project ddp-container 2>&1 | tail -n 8

step "2b. a command in the held job's container"
held=$(orch push "$job/config.py" --interactive on_startup --interactive-timeout-minutes 2 -o json \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["training_job"]["id"])')
for _ in $(seq 150); do
  orch logs --job-id "$held" 2>/dev/null | grep -q "final test accuracy\|FAILED" && break
  sleep 1
done
orch shell --job-id "$held" -- 'nvidia-smi -L; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; ls /dev | grep nvidia | tr "\n" " "; echo; ls $BT_CHECKPOINT_DIR | tr "\n" " "; echo'
echo "exit $?"
orch stop --job-id "$held" 2>&1 | tail -n 1
podman ps -a --format '{{.Names}} {{.Status}}'

step "view"
orch view --all 2>&1 | tail -n 6
orch cluster stop
