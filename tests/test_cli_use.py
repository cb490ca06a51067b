"""The command line as a user meets it: the installed ``convbn`` script and ``module:callable``
models from the current folder, ``bench --model module:callable``, ``explain --dtype /
--channels-last``, one-line errors for every shape mismatch, no abbreviated options, and
import failures that say what failed."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import convbn
from cli_helpers import assert_one_line_exit_2 as _one_line_exit_2, run_cli as _run
from convbn.cli import main

SRC = os.path.dirname(os.path.dirname(os.path.abspath(convbn.__file__)))

USER_NET = textwrap.dedent("""
    import torch.nn as nn

    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def norms():  # per-sample norms: Conv -> GroupNorm -> SiLU, Conv -> InstanceNorm -> LeakyReLU
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.LeakyReLU(0.01),
                             nn.Conv2d(8, 4, 1))

    def fixed():  # takes 3x8x8 only: its guessed 3x224x224 does not fit
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder holding ``usernet_cli_use.py``, as the current folder, NOT on sys.path."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "usernet_cli_use.py").write_text(USER_NET)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    monkeypatch.delitem(sys.modules, "usernet_cli_use", raising=False)
    return folder




def test_installed_script_imports_module_callable_from_the_current_folder(project, tmp_path):
    """The console script pip writes puts its own bin folder first on sys.path, not the current folder."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "convbn"
    script.write_text("import sys\nfrom convbn.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.run([sys.executable, str(script), "explain", "usernet_cli_use:build", "--input-shape", "2x3x8x8"],
                          cwd=project, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 pairs fused" in proc.stdout


def test_bench_takes_a_module_callable_model(project, capsys):
    code, out, err = _run(["bench", "--model", "usernet_cli_use:build", "--batch-size", "2", "--image-size", "8",
                           "--configs", "auto", "--no-compile", "--steps", "1", "--warmup", "0", "--memory-rounds", "1",
                           "--no-progress", "--wide"], capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines() if "usernet_cli_use:build" in line]
    assert any("eager" in r for r in rows) and any("convert" in r for r in rows), out


def test_bench_inference_takes_a_module_callable_model(project, capsys):
    code, out, err = _run(["bench", "--inference", "--model", "usernet_cli_use:build", "--batch-size", "2",
                           "--image-size", "8", "--repeats", "1", "--warmup", "0", "--no-progress"], capsys)
    assert code == 0, err
    assert "convbn.fold" in out and "usernet_cli_use:build" in out


def _saved(out):
    match = re.search(r"saved activation bytes: eager ([\d.]+ \w+), converted ([\d.]+ \w+)", out)
    assert match, out
    return match.groups()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_explain_dtype_and_channels_last(project, capsys, dtype):
    base = ["explain", "usernet_cli_use:build", "--input-shape", "2x3x16x16"]
    code, out32, err = _run(base, capsys)
    assert code == 0, err
    code, out, err = _run(base + ["--dtype", dtype, "--channels-last"], capsys)
    assert code == 0, err
    assert f"autocast {dtype}" in out and "channels-last" in out
    assert "2 pairs fused" in out
    # under autocast the convs save half-precision tensors: the saved bytes differ from float32's
    assert _saved(out) != _saved(out32)


def test_explain_a_norm_net_under_bf16_autocast_runs_the_fused_norm_chain(project, capsys):
    """GroupNorm / InstanceNorm chains run fused under autocast: the measured step peaks inside
    the norm chain's backward, not in eager modules."""
    code, out, err = _run(["explain", "usernet_cli_use:norms", "--input-shape", "2x3x16x16", "--dtype", "bfloat16",
                           "--channels-last"], capsys)
    assert code == 0, err
    assert "autocast bfloat16" in out and "3 pairs fused in 1 chains" in out, out
    assert "NormChainFunctionBackward" in out, out


def test_explain_channels_last_needs_a_4d_or_5d_input(project, capsys):
    _one_line_exit_2(*_run(["explain", "mnist", "--input-shape", "2x784", "--channels-last"], capsys),
                     "--channels-last", "4-D")


SHAPE_MISMATCH = [
    ["explain", "mnist", "--input-shape", "2x3x28x28"],
    ["fold", "mnist", "--input-shape", "2x3x28x28"],
    ["explain", "usernet_cli_use:fixed"],
    ["fold", "usernet_cli_use:fixed"],
    ["bench", "--model", "usernet_cli_use:fixed", "--batch-size", "2", "--configs", "auto", "--no-compile", "--steps",
     "1", "--warmup", "0", "--memory-rounds", "1", "--no-progress"],
    ["bench", "--inference", "--model", "usernet_cli_use:fixed", "--repeats", "1", "--warmup", "0", "--no-progress"],
    ["bench", "--ddp", "2", "--model", "usernet_cli_use:fixed", "--batch-size", "2", "--steps", "1", "--warmup", "0"],
]


@pytest.mark.parametrize("argv", SHAPE_MISMATCH, ids=[" ".join(a[:3]) for a in SHAPE_MISMATCH])
def test_every_shape_mismatch_is_one_line_exit_2(project, capsys, argv):
    code, out, err = _run(argv, capsys)
    _one_line_exit_2(code, out, err, "does not accept an input of shape")
    assert "Traceback" not in out


@pytest.mark.parametrize("argv,flag", [
    (["explain", "mnist", "--input-shap", "2x1x28x28"], "--input-shap"),
    (["demo", "--epoch", "1"], "--epoch"),
    (["bench", "--inference", "--repeat", "1"], "--repeat"),
    (["fold", "mnist", "--save-stat", "s.pt"], "--save-stat"),
])
def test_abbreviated_options_are_errors(capsys, argv, flag):
    _one_line_exit_2(*_run(argv, capsys), flag, "unrecognized")


def test_installed_library_that_fails_to_import_says_why(tmp_path, monkeypatch, capsys):
    """An installed package that raises while importing (torchvision's compiled ops on a CPU-only
    torch do this to timm) is reported with its exception, not with "install it"."""
    fake = tmp_path / "site"
    (fake / "efficientnet_pytorch").mkdir(parents=True)
    (fake / "efficientnet_pytorch" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delitem(sys.modules, "efficientnet_pytorch", raising=False)
    code, out, err = _run(["explain", "efficientnet:b0"], capsys)
    _one_line_exit_2(code, out, err, "'efficientnet_pytorch' is installed but fails to import",
                     "RuntimeError: operator torchvision::nms does not exist")
    assert "pip install" not in err


def test_user_module_that_raises_while_importing_is_one_line(project, capsys):
    (project / "brokennet_cli_use.py").write_text("raise RuntimeError('my own bug')\n")
    _one_line_exit_2(*_run(["explain", "brokennet_cli_use:build"], capsys), "brokennet_cli_use", "my own bug")
