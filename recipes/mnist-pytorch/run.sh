#!/usr/bin/env bash
# Entry point for the mnist-pytorch recipe: trains on sklearn's bundled digits.
# Set PYTHON to choose the interpreter; extra arguments go to train.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python}" "$here/train.py" "$@"
