#!/usr/bin/env bash
# Whole test suite: set up (if needed) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -n 2 -q "$@"
