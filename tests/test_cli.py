"""The ``convbn`` command line through its real entry point: --version, every subcommand's
--help (defaults shown), one-line errors with exit status 2 and no traceback, modes of ``bench``."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from convbn.cli import load_commands, main

ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")


def _convbn(*args, timeout=600):  # a guard against a hang only: generous for a loaded machine
    return subprocess.run([sys.executable, "-m", "convbn", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def test_commands_registered():
    assert [c.name for c in load_commands()] == ["demo", "bench", "explain", "fold"]


def test_version():
    proc = _convbn("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("convbn ")


@pytest.mark.parametrize("argv,must_show", [
    (["--help"], ["demo", "bench", "explain", "fold", "--version"]),
    (["demo", "--help"], ["--epochs", "(default: 3)", "--batch-size", "(default: 64)", "--mnist-dir", "--plot"]),
    (["bench", "--help"], ["--inference", "--ddp", "--model", "(default: 64)", "--json", "--markdown", "--plot",
                           "--device", "--dtype", "--image-size", "--wide"]),
    (["bench", "--inference", "--help"], ["--model", "(default: 8)", "--json", "--markdown", "--plot", "--device",
                                          "--dtype", "--image-size", "--repeats"]),
    (["bench", "--ddp", "2", "--help"], ["--model", "--batch-size", "--steps", "--device", "--json", "--markdown"]),
    (["explain", "--help"], ["SPEC", "--input-shape", "--strategy", "(default: auto)", "--memory-budget"]),
    (["fold", "--help"], ["SPEC", "--input-shape", "--save-state", "--save-script", "--save-export"]),
])
def test_help_of_every_subcommand_and_mode(capsys, argv, must_show):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in must_show:
        assert text in out, (argv, text)
    assert "--help-mode" not in out
    assert out.count("(default:") == len(re.findall(r"\(default: [^()]*\)", out))  # balanced, parseable
    for option_help in re.split(r"\s(?=--?[a-z])", out):  # one "(default: ...)" per option, never two
        assert option_help.count("(default:") <= 1, (argv, option_help)


BAD = [
    (["demo", "--batch-size", "-1"], "--batch-size", "-1"),
    (["demo", "--strategy", "auto"], "--strategy", "unrecognized"),
    (["demo", "--mnist-dir", "/nonexistent"], "--mnist-dir", "/nonexistent"),
    (["demo", "--epochs", "0"], "--epochs", "0"),
    (["demo", "--device", "foo"], "--device", "'foo'"),
    (["demo", "--device", "cuda"], "--device", "CUDA"),
    (["demo", "--plot", "/nonexistent/d.png"], "--plot", "/nonexistent"),
    (["bench", "--inference", "--model", "nonexistent"], "nonexistent", "'mnist'"),
    (["bench", "--inference", "--model", "monai:resnet18(spatial_dims=5)", "--repeats", "1", "--warmup", "0"],
     "spatial_dims=5", "could not be built"),
    (["bench", "--inference", "--batch-size", "-3"], "--batch-size", "-3"),
    (["bench", "--batch-size", "-3"], "--batch-size", "-3"),
    (["bench", "--device", "cuda"], "--device", "CUDA"),
    (["bench", "--inference", "--device", "foo"], "--device", "'foo'"),
    (["bench", "--memory-budget", "1.5"], "--memory-budget", "1.5"),
    (["bench", "--budget", "1.5"], "--budget", "1.5"),
    (["bench", "--plot", "/nonexistent/p.png"], "--plot", "/nonexistent"),
    (["bench", "--json", "/nonexistent/r.json"], "--json", "/nonexistent"),
    (["bench", "--markdown", "/"], "--markdown", "directory"),
    (["bench", "--inference", "--json", "/nonexistent/r.json"], "--json", "/nonexistent"),
    (["bench", "--model", "mnist", "--configs", "eager,bogus"], "bogus", "eager"),
    (["bench", "--inference", "--ddp", "2"], "--ddp", "not allowed"),
    (["bench", "--ddp", "0"], "--ddp", "0"),
    (["bench", "--no-such-flag"], "--no-such-flag", "unrecognized"),
    (["explain", "mnist", "--input-shape", "2x1xfoo"], "--input-shape", "2x1xfoo"),
    (["explain", "nosuchmodule.sub:build"], "nosuchmodule.sub", "import"),
    (["explain", "mnist", "--strategy", "recompute_bn", "--memory-budget", "0.5"], "--memory-budget", "auto"),
    (["fold", "mnist", "--save-script", "/nonexistent/m.pt"], "--save-script", "/nonexistent"),
    (["nosuchcommand"], "nosuchcommand", "choose from"),
]


def _check_one_line(code, out, err, names, allowed):
    assert code == 2, (code, err[-2000:])
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("convbn"), err
    assert names in err and allowed in err, err
    assert out == ""  # no work started


@pytest.mark.parametrize("argv,names,allowed", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_exit_2_no_traceback(capsys, argv, names, allowed):
    """Through the console entry point (``convbn.cli.main``, what ``convbn`` runs), in process."""
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("--device cuda is valid where CUDA is available")
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside main
        code = exc.code
    captured = capsys.readouterr()
    _check_one_line(code, captured.out, captured.err, names, allowed)


@pytest.mark.parametrize("argv,names,allowed", [BAD[0], BAD[2], BAD[8]], ids=["batch", "mnist-dir", "monai"])
def test_bad_input_through_python_m_convbn(argv, names, allowed):
    """The same through ``python -m convbn`` in a fresh process (a few cases: each costs an import of torch)."""
    proc = _convbn(*argv)
    _check_one_line(proc.returncode, proc.stdout, proc.stderr, names, allowed)


def test_debug_shows_the_traceback():
    proc = _convbn("bench", "--inference", "--model", "nonexistent", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_bench_training_mode_runs(tmp_path, capsys):
    md, js, png = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "t.png"
    code = main(["bench", "--model", "mnist", "--batch-size", "8", "--steps", "1", "--warmup", "0",
                 "--memory-rounds", "1", "--no-compile", "--configs", "eager,auto", "--no-progress",
                 "--markdown", str(md), "--json", str(js), "--plot", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert "peak meter: live tensors, exact" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "| mnist | convert auto |" in md.read_text() and "\\|Δout\\|" in md.read_text()
    assert {r["config"] for r in json.loads(js.read_text())} == {"eager", "convert auto"}
    assert png.stat().st_size > 1000


def test_bench_inference_mode_runs(tmp_path, capsys):
    js, png = tmp_path / "i.json", tmp_path / "i.png"
    with pytest.warns(UserWarning, match="--image-size 32 does not fit"):
        code = main(["bench", "--inference", "--model", "mnist", "--batch-size", "2", "--repeats", "1",
                     "--warmup", "0", "--no-progress", "--json", str(js), "--image-size", "32", "--plot", str(png)])
    assert code == 0
    assert "convbn.fold" in capsys.readouterr().out
    assert png.stat().st_size > 1000
    rows = json.loads(js.read_text())
    assert rows[0]["model"] == "mnist" and rows[0]["input_shape"] == [2, 1, 28, 28]


def test_inference_old_models_flag_still_works(capsys):
    with pytest.warns(FutureWarning, match="repeat --model"):
        code = main(["bench", "--inference", "--models", "mnist", "--batch-size", "2", "--repeats", "1",
                     "--warmup", "0", "--no-progress", "--markdown"])
    assert code == 0 and "| mnist | convbn.fold |" in capsys.readouterr().out


def test_inference_ignored_image_size_warns():
    proc = _convbn("bench", "--inference", "--model", "mnist", "--batch-size", "2", "--repeats", "1", "--warmup", "0",
                   "--no-progress", "--image-size", "32")
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "--image-size 32" in warning[0] and warning[0].startswith("convbn: warning:")


def test_explain_prints_per_layer_report(capsys):
    assert main(["explain", "mnist", "--input-shape", "4x1x28x28"]) == 0
    out = capsys.readouterr().out
    assert "conv1" in out and "bn1" in out and ("recompute_bn" in out or "recompute_conv" in out)
    assert "kept" in out and "extra MACs" in out


def test_explain_user_callable(tmp_path, capsys, monkeypatch):
    (tmp_path / "usernets_cli.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "usernets_cli:build", "--input-shape", "2x3x8x8"]) == 0
    out = capsys.readouterr().out
    assert "1 pairs fused" in out and "skipped" in out


def test_fold_reports_checks_and_saves(tmp_path, capsys):
    import torch

    state, script = tmp_path / "s.pt", tmp_path / "m.pt"
    assert main(["fold", "mnist", "--batch-size", "2", "--save-state", str(state), "--save-script", str(script)]) == 0
    out = capsys.readouterr().out
    assert "2 folded" in out and "max |folded - original|" in out
    sd = torch.load(state)
    assert not any("bn" in k for k in sd)
    loaded = torch.jit.load(str(script))
    assert loaded(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.expect_unfused("the warning convert gives when it fuses nothing")
def test_convert_that_fuses_nothing_warns():
    import warnings

    import torch.nn as nn

    from convbn import convert

    with pytest.warns(UserWarning, match=r"convbn.convert fused nothing in Sequential"):
        convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with a pair converts without a warning
        convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))


def test_ignored_bench_options_warn(tmp_path):
    from convbn.bench.command import _add_training
    from convbn.bench.training import main_training
    from convbn.cli import ArgumentParser

    parser = ArgumentParser()
    _add_training(parser)
    args = parser.parse_args(["--model", "nosuch:net", "--no-compile", "--compile-budget", "0.5", "--configs", "eager",
                              "--memory-budget", "0.4"])
    with pytest.warns(UserWarning) as record, pytest.raises(ImportError, match="cannot import module 'nosuch'"):
        main_training(args)
    text = " ".join(str(w.message) for w in record)
    assert "--compile-budget is ignored with --no-compile" in text and "--memory-budget is ignored" in text


def test_fold_saves_an_exported_program(tmp_path, capsys):
    import torch

    path = tmp_path / "m.pt2"
    assert main(["fold", "mnist", "--batch-size", "2", "--save-export", str(path)]) == 0
    assert "torch.export program (dynamic batch) written" in capsys.readouterr().out
    program = torch.export.load(str(path))
    assert program.module()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
