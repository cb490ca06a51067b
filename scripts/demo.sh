#!/usr/bin/env bash
# Main job: set up (if needed) and run the MNIST-style training demo, fused vs unfused.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m convbn demo "$@"
