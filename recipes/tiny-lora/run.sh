#!/usr/bin/env bash
# Entry point for the tiny-lora recipe: full and LoRA fine-tunes of a tiny LM on CPU.
# Set PYTHON to choose the interpreter; extra arguments go to train.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python}" "$here/train.py" "$@"
