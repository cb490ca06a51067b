#!/usr/bin/env bash
# Whole test suite: set up (if needed) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# one BLAS thread per worker: 2 workers on 2 cores, no oversubscription
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# a fresh inductor cache per run: its FX-graph cache key does not cover the fake kernels of
# convbn's custom ops, so code compiled by an older checkout could be reused
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
exec python -m pytest -n 2 -q "$@"
