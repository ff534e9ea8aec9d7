#!/usr/bin/env bash
# The recipes on a real GPU machine, through the CLI and the embedded local Ray, as a user runs them.
#
# 1. the main command's job (recipes/mnist-pytorch) as it is;
# 2. recipes/multinode-ddp on one node with accelerator H100:1 (nccl on cuda:0): the job's line
#    must show CUDA_VISIBLE_DEVICES set by Ray and the GPU's name, and nvidia-smi must see the
#    trainer's process while it runs; its checkpoints must be listed as uploaded; its GPU
#    samples (`orchestrator metrics`, every 1 s) beside nvidia-smi's own (every 0.5 s);
# 3. a job asking for more GPUs than the machine has, and one asking for another accelerator
#    type: each must end DEPLOY_FAILED with the shortfall named.
#
# Usage: benchmarks/gpu_check.sh [WHEEL_DIR]   (results under $OUT, or /tmp/gpu-check)
# WHEEL_DIR (absolute, or relative to the repository's root, where the script runs): wheels of
# what the machine lacks (Ray, pydantic, ...), installed into /tmp/site; the device tool's README
# says how to download them. Ray's wheel is over the 64 MiB a call carries:
# repack it without ray/jars and ray/rllib (Java and RLlib, unused here).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
wheels="${1:-.whl}"
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
fi
export ORCHESTRATOR_SCHEDULING_TIMEOUT_S=20 PYTHONUNBUFFERED=1
orch() { python3 -c 'import sys; from orchestrator.cli.app import main; sys.argv[0] = "orchestrator"; main()' "$@"; }
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, ray, pydantic; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "ray", ray.__version__, "pydantic", pydantic.VERSION)'

step "1. main job: recipes/mnist-pytorch"
start=$(date +%s%N)
orch push recipes/mnist-pytorch/config.py --tail 2>&1 | tee "$out/mnist.log" | tail -n 6
echo "exit ${PIPESTATUS[0]}; push -> end $(( ($(date +%s%N) - start) / 1000000 )) ms"
orch cluster status

step "2. multinode-ddp on accelerator H100:1"
job=/tmp/ddp-gpu
mkdir -p "$job" && cp recipes/multinode-ddp/run.sh recipes/multinode-ddp/train.py "$job"/
sed -e 's/node_count=2,/node_count=1,/' \
    -e 's/# accelerator=definitions.AcceleratorSpec(accelerator="H100", count=8)/accelerator=definitions.AcceleratorSpec(accelerator="H100", count=1)/' \
    -e 's/name="multinode-ddp"/name="ddp-gpu"/' \
    -e "s/\&\& \.\/run\.sh'/\&\& .\/run.sh --epochs 30'/" \
    recipes/multinode-ddp/config.py > "$job/config.py"
grep -n "accelerator=\|node_count\|run.sh" "$job/config.py"
(while sleep 0.5; do nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader; done) \
  > "$out/nvidia-smi-apps.log" 2>&1 &
watcher=$!
(while sleep 0.5; do
   nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits | sed "s/^/$(date +%s.%N), /"
 done) > "$out/nvidia-smi-gpu.csv" 2>&1 &
gpu_watcher=$!
start=$(date +%s%N)
ORCHESTRATOR_METRICS_INTERVAL_S=1 orch push "$job/config.py" --tail 2>&1 | tee "$out/ddp-gpu.log" | grep -v "^\s*$" | tail -n 14
echo "exit ${PIPESTATUS[0]}; push -> end $(( ($(date +%s%N) - start) / 1000000 )) ms"
kill "$watcher" "$gpu_watcher"
orch metrics --project ddp-gpu -o json > "$out/ddp-gpu-metrics.json" 2>/dev/null
python3 - "$out" <<'PY'
import csv, json, sys
out = sys.argv[1]
smi = [(float(t), i, u, m) for t, i, u, m in
       (r for r in csv.reader(open(f"{out}/nvidia-smi-gpu.csv")) if len(r) == 4)]
ours = [(s["at"], g["index"], g["utilization_pct"], g["memory_used_bytes"] / 2**20)
        for r in json.load(open(f"{out}/ddp-gpu-metrics.json"))["ranks"]
        for s in r["samples"] for g in s.get("gpus", [])]
def summary(name, rows):
    busy = [float(u) for _, _, u, _ in rows if float(u) > 0]
    print(f"{name}: {len(rows)} samples, GPUs {sorted({str(i).strip() for _, i, _, _ in rows})}, "
          f"idle memory (first sample) {float(rows[0][3]) if rows else 0:.0f} MiB, "
          f"peak memory {max((float(m) for _, _, _, m in rows), default=0):.0f} MiB, "
          f"mean utilisation while busy {sum(busy) / max(len(busy), 1):.0f}%")
summary("nvidia-smi", smi)
summary("orchestrator metrics", ours)
# Each of our samples between nvidia-smi's samples just before and just after it: memory is a
# level and must lie between them (to 8 MiB); where both agree (memory steady), the difference
# is what our figure gets wrong. Utilisation is a mean over each tool's own window: rough only.
smi.sort()
steady, between, outside, pairs = [], 0, [], []
for o in ours:
    before = [s for s in smi if s[0] <= o[0]]
    after = [s for s in smi if s[0] > o[0]]
    if not before or not after:
        continue
    b, a = before[-1], after[0]
    lo, hi = sorted((float(b[3]), float(a[3])))
    if hi - lo <= 8:
        steady.append(o[3] - (lo + hi) / 2)
    elif lo - 8 <= o[3] <= hi + 8:
        between += 1
    else:
        outside.append((round(o[3]), lo, hi))
    if o[2] or float(b[2]) or float(a[2]):
        pairs.append(f"{o[2]:.0f}/{b[2].strip()}-{a[2].strip()}")
print(f"memory, ours against nvidia-smi: {len(steady)} samples while steady, differences "
      f"{min(steady, default=0):+.0f} to {max(steady, default=0):+.0f} MiB; {between} while it "
      f"changed, between nvidia-smi's samples before and after; {len(outside)} outside {outside}")
print("utilisation, ours / nvidia-smi's before-after, where either is above 0: " + " ".join(pairs))
PY
echo "nvidia-smi saw on the GPU while the job ran:"; sort -u "$out/nvidia-smi-apps.log" | head -n 5
grep -o "CUDA_VISIBLE_DEVICES=[^ ]*\|gpu=.*\|backend=[a-z]*" "$out/ddp-gpu.log" | sort | uniq -c
orch checkpoints list --project ddp-gpu 2>&1 | tail -n 8

step "2b. a command inside a held GPU job (orchestrator shell -- CMD)"
held=$(orch push "$job/config.py" --interactive on_startup --interactive-timeout-minutes 2 -o json \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["training_job"]["id"])')
for _ in $(seq 120); do
  orch logs --job-id "$held" 2>/dev/null | grep -q "final test accuracy" && break
  sleep 1
done
orch shell --job-id "$held" -- 'nvidia-smi -L; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; ls $BT_CHECKPOINT_DIR | tr "\n" " "'
echo "exit $?"
orch view --job-id "$held" 2>&1 | grep -i "held\|status" | head -n 3
orch stop --job-id "$held" 2>&1 | tail -n 1

step "3. more GPUs than the machine has (H100:2), and another type (A100:1)"
for acc in H100:2 A100:1; do
  orch push "$job/config.py" --accelerator "$acc" --tail 2>&1 | grep -v "^\s*$" | tail -n 4
  echo "exit ${PIPESTATUS[0]}"
done

step "view"
orch view --all 2>&1 | tail -n 8
orch cluster stop
