"""Progress of long work: a line per stage on stderr where asked or where stderr is a
terminal, nothing otherwise, and the same results either way."""
import io
import sys

import pytest
import torch
import torch.nn as nn

import convbn
from convbn.cli import main
from convbn.progress import progress_scope, stage
from fusion_checks import assert_fused


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _lines(err):
    return [l for l in err.splitlines() if l.startswith("[convbn")]


def test_scope_prints_when_on_and_nested_scopes_follow_it(capsys):
    with progress_scope("outer", True):
        stage("one")
        with progress_scope("inner"):
            stage("two")
        with progress_scope("silent", False):
            stage("three")
    err = capsys.readouterr().err
    lines = _lines(err)
    assert len(lines) == 2 and lines[0].endswith("outer: one") and lines[1].endswith("  inner: two")
    with progress_scope("off", False):
        stage("nothing")
        with progress_scope("inner"):  # None under a quiet scope: quiet
            stage("nothing either")
    stage("outside every scope")
    assert capsys.readouterr().err == ""


def test_auto_prints_only_where_stderr_is_a_terminal(capsys, monkeypatch):
    with progress_scope("auto"):  # pytest's captured stderr is no terminal
        stage("quiet")
    assert capsys.readouterr().err == ""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with progress_scope("auto"):
        stage("shown")
    assert term.getvalue().rstrip().endswith("auto: shown")


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_convert_prints_its_stages_and_converts_the_same(capsys):
    torch.manual_seed(0)
    net, x = _net(), torch.randn(4, 3, 12, 12)
    quiet = convbn.convert(net, example_inputs=x, progress=False)
    assert capsys.readouterr().err == ""
    shown = convbn.convert(net, example_inputs=x, progress=True)
    lines = _lines(capsys.readouterr().err)
    for text in ("convert: trace and match Sequential", "convert: check the model", "convert: plan: measuring"):
        assert any(text in l for l in lines), (text, lines)
    auto = convbn.convert(net, example_inputs=x)  # stderr captured: no terminal, no lines
    assert capsys.readouterr().err == ""
    for m in (quiet, shown, auto):
        assert_fused(m, pairs=2)
    assert str(quiet.convbn_report) == str(shown.convbn_report) == str(auto.convbn_report)
    out_q, grads_q = _step(quiet, x)
    out_s, grads_s = _step(shown, x)
    assert torch.equal(out_q, out_s) and all(torch.equal(a, b) for a, b in zip(grads_q, grads_s))


def test_explain_and_max_batch_print_their_stages_and_answer_the_same(capsys):
    torch.manual_seed(0)
    net, x = _net(), torch.randn(2, 3, 12, 12)
    report = convbn.explain(net, x, progress=True)
    lines = _lines(capsys.readouterr().err)
    assert any("explain: measuring a step" in l for l in lines) and any("  convert: plan" in l for l in lines)
    assert str(report) == str(convbn.explain(net, x, progress=False)) and capsys.readouterr().err == ""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    shown = convbn.max_batch(net, x, "1MiB", optimizer=opt, progress=True)
    lines = _lines(capsys.readouterr().err)
    for text in ("max_batch: eager: a recorded step at batch 2", "max_batch: eager: a recorded step at batch 3",
                 "max_batch: convbn: a recorded step at batch 3, planned as predicted", f"eager batch {shown.eager_batch}, convbn batch"):
        assert any(text in l for l in lines), (text, lines)
    quiet = convbn.max_batch(net, x, "1MiB", optimizer=opt, progress=False)
    assert capsys.readouterr().err == ""
    assert str(shown) == str(quiet) and shown.probes == quiet.probes


@pytest.mark.parametrize("call", [
    lambda net, x: convbn.convert(net, example_inputs=x, progress="yes"),
    lambda net, x: convbn.explain(net, x, progress=1),
])
def test_a_bad_progress_is_refused_before_any_work(call, monkeypatch):
    import convbn.passes.convert.api as api

    monkeypatch.setattr(api, "share_copy", lambda *a: pytest.fail("work started"))
    with pytest.raises(TypeError, match="progress must be None"):
        call(_net(), torch.randn(2, 3, 8, 8))


def test_cli_explain_memory_progress_flags(tmp_path, monkeypatch, capsys):
    (tmp_path / "progress_nets.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),\n"
        "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))\n")
    monkeypatch.chdir(tmp_path)
    argv = ["explain", "progress_nets:build", "--input-shape", "2x3x12x12", "--memory", "1MiB"]
    outs = {}
    for flag in ("--progress", "--quiet", None):
        torch.manual_seed(0)
        assert main(argv + ([flag] if flag else [])) == 0
        captured = capsys.readouterr()
        outs[flag] = captured.out
        lines = _lines(captured.err)
        if flag == "--progress":
            assert any("max_batch: eager: a recorded step at batch 2" in l for l in lines), lines
            assert any("convert: check" in l for l in lines), lines
        else:  # --quiet, and the default where stderr is no terminal
            assert lines == []
    assert outs["--progress"] == outs["--quiet"] == outs[None] and "in 1.0 MiB: eager trains batch" in outs[None]


def test_bench_progress_flags_parse():
    from convbn.cli import build_parser

    parser = build_parser(argv=["bench"])
    base = ["bench", "--model", "mnist"]
    assert parser.parse_args(base).progress is None
    assert parser.parse_args(base + ["--progress"]).progress is True
    assert parser.parse_args(base + ["--quiet"]).progress is False
    assert parser.parse_args(base + ["--no-progress"]).progress is False
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--quiet", "--progress"])
