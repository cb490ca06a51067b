"""The command line's errors as a new user meets them, each one line with exit status 2, and every
option checked before any work starts.

Model specs: a builder that raises, an ``nn.Module`` instance named as ``module:attr``, a Python
file ``./file.py:fn``, a bare module name. Options: an unknown option is reported by its
subcommand with the closest option; ``--memory``, ``--checkpoint``, ``--timeline``, a missing
package (``convbn[onnx]``, ``convbn[demo]``, ``convbn[cli]``) and a bad ``--model`` fail before the
demo trains, before ``fold`` folds, before ``bench`` runs a model (the work is replaced by a
function that fails the test if called).
"""
from __future__ import annotations

import sys
import textwrap

import pytest

import convbn.bench.ddp as bench_ddp
import convbn.bench.training as bench_training
import convbn.demo as demo
import convbn.passes.fold.api as fold_api
from cli_helpers import assert_one_line_exit_2, run_cli as _run
from convbn.cli import main

NETS = textwrap.dedent("""
    from torch import nn

    def resnet():
        raise ValueError("depth must be one of 18, 34")

    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)).relu()

    net = build()  # an instance, not a builder
    DEPTH = 3
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The current folder holds ``errnets_cli.py``; sys.path and sys.modules are restored afterwards."""
    (tmp_path / "errnets_cli.py").write_text(NETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in [m for m in sys.modules if m.startswith(("errnets_cli", "convbn_user_model_"))]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("errnets_cli", "convbn_user_model_"))]:
        del sys.modules[name]


def _one_line(code, out, err, *must):
    assert_one_line_exit_2(code, out, err, *must)
    assert out == "", out  # no work started
    return err


def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad argument was reported")
    return fail


# --------------------------------------------------------------------------- model specs


@pytest.mark.expect_unfused("the builder raises: nothing is built")
def test_builder_that_raises_is_one_line(project, capsys):
    err = _one_line(*_run(["explain", "errnets_cli:resnet"], capsys),
                    "building errnets_cli:resnet raised ValueError: depth must be one of 18, 34", "--debug")
    assert err.startswith("convbn explain: error:"), err


@pytest.mark.expect_unfused("the builder raises: nothing is built")
def test_builder_that_raises_shows_its_traceback_with_debug(project, capsys):
    with pytest.raises(ValueError, match="building errnets_cli:resnet raised ValueError") as info:
        main(["explain", "errnets_cli:resnet", "--debug"])
    assert isinstance(info.value.__cause__, ValueError) and "depth must be" in str(info.value.__cause__)


def test_module_instance_is_used_as_it_is(project, capsys):
    code, out, err = _run(["explain", "errnets_cli:net", "--input-shape", "2x3x8x8"], capsys)
    assert code == 0, err
    assert out.startswith("errnets_cli:net, input 2x3x8x8") and "1 pairs fused" in out, out


def test_python_file_spec(project, capsys):
    (project / "sub").mkdir()
    (project / "sub" / "my_file_nets.py").write_text(NETS)
    for spec in ("./sub/my_file_nets.py:Net", str(project / "sub" / "my_file_nets.py") + ":build"):
        code, out, err = _run(["explain", spec, "--input-shape", "2x3x8x8"], capsys)
        assert code == 0, (spec, err)
        assert out.startswith(f"{spec}, input 2x3x8x8") and "1 pairs fused" in out, out


@pytest.mark.expect_unfused("the file does not exist: nothing is built")
def test_missing_python_file_is_named(project, capsys):
    _one_line(*_run(["explain", "./nofile.py:build"], capsys),
              "no Python file './nofile.py'", str(project / "nofile.py"))


@pytest.mark.expect_unfused("a bare module is not a spec: nothing is built")
def test_bare_module_says_the_form_and_lists_builders(project, capsys):
    _one_line(*_run(["explain", "errnets_cli"], capsys),
              "'errnets_cli' is a module", "module:callable", "e.g. errnets_cli:resnet",
              "candidates: resnet, build, Net, net")


@pytest.mark.expect_unfused("an unknown name is not a spec: nothing is built")
def test_unknown_bare_name_says_what_a_spec_is(project, capsys):
    _one_line(*_run(["explain", "nosuchmodule_cli_errors"], capsys),
              "unknown model 'nosuchmodule_cli_errors'", "module:callable", "monai:resnet18", "'mnist'")


@pytest.mark.expect_unfused("the attribute is not a builder: nothing is built")
def test_attribute_that_is_not_a_builder_lists_candidates(project, capsys):
    _one_line(*_run(["explain", "errnets_cli:DEPTH"], capsys), "type int", "candidates in it: resnet, build")
    _one_line(*_run(["explain", "errnets_cli:nope"], capsys), "'errnets_cli' has no 'nope'", "candidates in it")


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("argv,prog,wrong,right", [
    (["explain", "mnist", "--input-shap", "2x1x28x28"], "convbn explain", "--input-shap", "--input-shape"),
    (["fold", "mnist", "--save-onx", "m.onnx"], "convbn fold", "--save-onx", "--save-onnx"),
    (["demo", "--epoch", "1"], "convbn demo", "--epoch", "--epochs"),
    (["bench", "--inference", "--repeat", "1"], "convbn bench", "--repeat", "--repeats"),
])
def test_unknown_option_is_reported_by_its_subcommand_with_a_suggestion(capsys, argv, prog, wrong, right):
    err = _one_line(*_run(argv, capsys), f"unrecognized arguments: {wrong}", f"did you mean {right}?",
                    f"see '{prog} --help'")
    assert err.startswith(f"{prog}: error:"), err


@pytest.mark.parametrize("argv", [["demo", "--memory", "12XB"], ["explain", "mnist", "--memory", "12XB"]])
def test_memory_size_is_checked_while_parsing(capsys, monkeypatch, argv):
    monkeypatch.setattr(demo, "run_demo", _must_not_run("the demo"))
    _one_line(*_run(argv, capsys), "argument --memory", "'12XB'", "16GiB")


def test_run_demo_checks_memory_before_training(monkeypatch):
    monkeypatch.setattr(demo, "build_models", _must_not_run("training"))
    with pytest.raises(ValueError, match="'12XB'"):
        demo.run_demo(demo.DemoConfig(epochs=1, limit=64, progress=False, memory="12XB"))


@pytest.mark.parametrize("argv", [
    ["explain", "mnist", "--checkpoint", "nope.pt"],
    ["fold", "mnist", "--checkpoint", "nope.pt"],
    ["bench", "--model", "mnist", "--checkpoint", "nope.pt"],
    ["bench", "--inference", "--model", "mnist", "--checkpoint", "nope.pt"],
])
def test_missing_checkpoint_is_checked_while_parsing(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("convbn.bench.models.build_model", _must_not_run("building the model"))
    _one_line(*_run(argv, capsys), "argument --checkpoint", "'nope.pt' does not exist")


def test_fold_save_onnx_checks_the_exporter_before_folding(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed
    monkeypatch.setattr(fold_api, "fold", _must_not_run("fold"))
    _one_line(*_run(["fold", "mnist", "--save-onnx", str(tmp_path / "m.onnx")], capsys),
              "--save-onnx needs onnxscript: pip install 'convbn[onnx]'")


def test_demo_checks_its_packages_before_training(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    monkeypatch.setattr(demo, "run_demo", _must_not_run("the demo"))
    _one_line(*_run(["demo", "--no-plot"], capsys),
              "convbn demo needs scikit-learn: pip install 'convbn[demo]' (or pass --mnist-dir DIR)")


def test_demo_checks_matplotlib_before_training(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(demo, "run_demo", _must_not_run("the demo"))
    _one_line(*_run(["demo"], capsys), "needs matplotlib: pip install 'convbn[demo]' (or pass --no-plot)")


def test_bench_checks_rich_before_running(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setattr(bench_training, "run_training_bench", _must_not_run("the benchmark"))
    _one_line(*_run(["bench", "--model", "mnist"], capsys), "convbn bench needs rich: pip install 'convbn[cli]'")


def test_bench_timeline_path_is_checked_while_parsing(capsys):
    _one_line(*_run(["bench", "--timeline", "/nonexistent/t.png"], capsys), "argument --timeline", "/nonexistent")


def test_bench_checks_every_model_spec_before_the_first_runs(project, monkeypatch, capsys):
    monkeypatch.setattr(bench_training, "run_training_bench", _must_not_run("the benchmark"))
    _one_line(*_run(["bench", "--model", "mnist", "--model", "nosuchmodule_cli_errors:build"], capsys),
              "cannot import module 'nosuchmodule_cli_errors'")
    _one_line(*_run(["bench", "--model", "mnist", "--model", "errnets_cli:nope"], capsys),
              "'errnets_cli' has no 'nope'")


def test_bench_ddp_checks_every_model_spec_before_launching(project, monkeypatch, capsys):
    monkeypatch.setattr(bench_ddp, "run_ddp_bench", _must_not_run("the data-parallel benchmark"))
    _one_line(*_run(["bench", "--ddp", "2", "--model", "mnist", "--model", "errnets_cli:nope"], capsys),
              "'errnets_cli' has no 'nope'")
