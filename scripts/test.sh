#!/usr/bin/env bash
# Whole test suite: set up (if needed) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# one BLAS thread per worker: 2 workers on 2 cores, no oversubscription
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -n 2 -q "$@"
