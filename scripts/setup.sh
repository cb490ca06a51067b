#!/usr/bin/env bash
# Idempotent set-up of the dev environment in .venv (CPU torch pinned by constraints-dev.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.convbn-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-dev.txt -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip
    # torch first, from the pinned CPU build, so no dependency can pull another torch.
    python -m pip install -q -c constraints-dev.txt "torch==2.13.0"
    # .[dev] includes convbn[onnx] (onnx, onnxscript, onnxruntime) and convbn[integrations]
    # (lightning, pytorch-ignite), pinned by constraints-dev.txt
    python -m pip install -q -c constraints-dev.txt -e ".[dev]"
    # the documentation site's tools (convbn[docs]): tests/test_docs.py builds it in strict mode
    python -m pip install -q -c constraints-dev.txt -e ".[docs]"
    # torchvision / timm model code for the real-model tests and benchmarks: installed without
    # dependencies (pip would otherwise resolve another torch); torchvision's compiled ops do
    # not load on this CPU torch, so tests import it through tests/zoo.py (see there).
    python -m pip install -q -c constraints-dev.txt huggingface_hub pyyaml safetensors
    python -m pip install -q --no-deps -c constraints-dev.txt torchvision timm
    # ultralytics' trainer for tests/test_integration_trainer.py: without its dependencies too
    # (it would resolve another torch); training needs only OpenCV besides what is here.
    python -m pip install -q -c constraints-dev.txt opencv-python-headless
    python -m pip install -q --no-deps -c constraints-dev.txt ultralytics
    touch "$stamp"
fi
# graphviz's `dot` draws the autograd graphs of the examples; optional, best effort.
if ! command -v dot >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq graphviz) >/dev/null 2>&1 || echo "note: graphviz not installed; graph drawings will be skipped"
fi
