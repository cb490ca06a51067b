"""Run each example script end to end, as a user would."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> graph file stems it draws
SCRIPTS: Dict[str, List[str]] = {
    "conv2d_function.py": ["conv2d_forward", "conv2d_grad_input"],
    "batchnorm2d_function.py": ["batchnorm2d_forward"],
    "fused_conv_bn_function.py": ["fused_conv_bn", "unfused_conv_bn"],
    "linear_function.py": ["linear_function"],
    "double_backward.py": [
        "double_backward_save_input_square",
        "double_backward_save_output_exp",
        "double_backward_save_intermediate_sinh",
        "double_backward_wrong_ctx_stash_sinh",
        "double_backward_untraceable_backward_cube",
    ],
}

CAN_DRAW = shutil.which("dot") is not None and importlib.util.find_spec("torchviz") is not None


def _run(
    script: str, out_dir: Path, extra_env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--out", str(out_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs_and_draws(script: str, tmp_path: Path) -> None:
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    assert "[FAIL]" not in result.stdout
    if CAN_DRAW:
        for stem in SCRIPTS[script]:
            for suffix in (".svg", ".png"):
                drawn = tmp_path / f"{stem}{suffix}"
                assert drawn.is_file() and drawn.stat().st_size > 0, drawn
    else:
        assert "skipping graph drawing:" in result.stdout


def test_example_without_dot_skips_drawing(tmp_path: Path) -> None:
    # An empty PATH hides graphviz's `dot`: the example must say so and still succeed.
    result = _run("linear_function.py", tmp_path, {"PATH": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    skip_lines = [line for line in result.stdout.splitlines() if line.startswith("skipping graph drawing:")]
    assert len(skip_lines) == 1 and "install" in skip_lines[0]
    assert not list(tmp_path.glob("*.svg"))


def test_examples_have_docstrings() -> None:
    for script in SCRIPTS:
        source = (EXAMPLES / script).read_text()
        assert source.lstrip().startswith('"""'), script


DOCUMENTED_MODULES = [
    "convbn.reference.conv2d",
    "convbn.reference.batchnorm2d",
    "convbn.reference.tutorial_fused",
    "convbn.reference.linear",
    "convbn.reference.ctx_tools",
    "convbn.reference.double_backward",
    "convbn.gradcheck",
    "convbn.functional.strategies",
    "convbn.memory.saved",
    "convbn.memory.peaks",
    "convbn.memory.timelines",
    "convbn.passes.convert.match_tail",
    "convbn.functional.activations",
    "convbn.autograd.chain_memory",
    "convbn.autograd.layer_functions",
    "convbn.functional.pool",
    "convbn.functional.conv",
    "convbn.passes.plan.planner",
    "convbn.passes.plan.peak_model",
    "convbn.passes.plan.peak_planner",
    "convbn.passes.plan.chain_plans",
    "convbn.autograd.chain_plan",
    "convbn.autograd.chain_structure",
    "convbn.autograd.pool",
    "convbn.nn.pool",
]


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_docstring_examples_run(module_name: str) -> None:
    import doctest
    import importlib

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module = importlib.import_module(module_name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    finally:
        torch.set_num_threads(before)
    assert result.attempted > 0 and result.failed == 0
