#!/usr/bin/env bash
# Check this checkout against one torch release from the package index (a release check;
# docs/torch-versions.md has the results and what it costs).
#
#   bash scripts/test_torch.sh VERSION [--constraint FILE] [PYTEST ARGS...]
#
# Builds (once) a venv of its own with torch==VERSION, outside the repository:
# $CONVBN_TORCH_VENVS/convbn-torch-VERSION (default /work/venvs). The standard wheels of the
# package index are CUDA builds of a few GB (torch and its nvidia-* wheels); they run on a CPU.
# pip's constraint for that venv is a file of its own, torch==VERSION plus --constraint FILE
# if given (PIP_CONSTRAINT replaces a machine-wide constraint such as a cap on torch).
# Installs the checkout into it (a wheel built from this tree: not editable, no other venv
# touched), then checks, in that venv:
#   1. `import convbn` (the installed one) and `convbn --version`
#   2. the README example: its pairs fused and its BatchNorms folded
#   3. the compatibility subset: the tests tests/compat_subset.txt lists (`-m compat`)
# and prints one summary line. Exit status: 0 when all three pass.
set -euo pipefail

usage() { echo "usage: bash scripts/test_torch.sh VERSION [--constraint FILE] [PYTEST ARGS...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
VERSION=$1
shift
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "test_torch.sh: VERSION must look like 2.8.0, got '$VERSION'" >&2; exit 2; }
EXTRA=""
if [ "${1:-}" = "--constraint" ]; then
    [ $# -ge 2 ] && [ -f "$2" ] || { echo "test_torch.sh: --constraint needs an existing file" >&2; exit 2; }
    EXTRA=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
    shift 2
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${CONVBN_TORCH_VENVS:-/work/venvs}
VENV=$VENVS/convbn-torch-$VERSION
PY=$VENV/bin/python
mkdir -p "$VENVS"
[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"

# the venv's own constraint file: this torch, and the caller's pins
{ echo "torch==$VERSION"; [ -z "$EXTRA" ] || cat "$EXTRA"; } > "$VENV/constraints.txt"
export PIP_CONSTRAINT=$VENV/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1
have=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$VERSION" ] || ! "$PY" -c 'import pytest, hypothesis, numpy' 2>/dev/null; then
    echo "== installing torch==$VERSION into $VENV (several GB the first time)"
    "$PY" -m pip install -q "torch==$VERSION" pytest hypothesis numpy
fi
# the real models of the subset (pure Python; --no-deps: they would resolve another torch), and
# rich for the command line's tables (convbn[cli]; it needs no torch)
"$PY" -c 'import monai, efficientnet_pytorch, rich' 2> /dev/null \
    || { "$PY" -m pip install -q --no-deps monai efficientnet_pytorch && "$PY" -m pip install -q rich; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "== installing this checkout ($ROOT) into $VENV"
# from a copy of the files git knows (tracked, and new ones not ignored): the build leaves no
# build/ in the checkout, and a stale build/ cannot leak into the wheel
if git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    mkdir "$WORK/checkout"
    (cd "$ROOT" && git ls-files -z -c -o --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2> /dev/null | tar -xf - -C "$WORK/checkout")
    SOURCE=$WORK/checkout
else
    SOURCE=$ROOT
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$SOURCE"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor
unset PYTHONPATH
status=0

echo "== import convbn / convbn --version"
cd "$WORK"
if "$PY" -c 'import convbn, sys; f = convbn.__file__; print(f); sys.exit(0 if "site-packages" in f else 1)' \
        && "$VENV/bin/convbn" --version; then
    imported=ok
else
    imported=FAILED
    status=1
fi

echo "== the README example"
sed -n '/^```python/,/^```/p' "$ROOT/README.md" | sed '1d;$d' > "$WORK/readme_example.py"
if "$PY" readme_example.py > "$WORK/readme.out" 2>&1; then
    cat "$WORK/readme.out"
    pairs=$(grep -o -m1 '[0-9]* pairs fused' "$WORK/readme.out" | cut -d' ' -f1)
    folded=$(grep -o -m1 '[0-9]* folded' "$WORK/readme.out" | cut -d' ' -f1)
    if [ "${pairs:-0}" -gt 0 ] && [ "${folded:-0}" -gt 0 ]; then
        readme="ok ($pairs pairs fused, $folded folded)"
    else
        readme="FAILED (${pairs:-0} pairs fused, ${folded:-0} folded)"
        status=1
    fi
else
    tail -20 "$WORK/readme.out"
    readme=FAILED
    status=1
fi

echo "== the compatibility subset (tests/compat_subset.txt)"
cd "$ROOT"
mapfile -t files < <(grep -v '^#' tests/compat_subset.txt | sed '/^\s*$/d; s/::.*//' | sort -u)
set +e
"$PY" -m pytest -q -m compat -p no:cacheprovider "${files[@]}" "$@" 2>&1 | tee "$WORK/pytest.out"
rc=${PIPESTATUS[0]}
set -e
subset=$(grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$WORK/pytest.out" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
[ "$rc" -eq 0 ] || status=1

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
echo "torch $torch_version: import $imported; README $readme; compat subset: ${subset:-no result (exit $rc)}"
exit $status
