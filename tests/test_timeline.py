"""``convbn.memory.timeline``: live bytes after every operator of one training step.

Its maximum is the step's exact live-tensor peak (``tensor_peak``), its points carry the
phase, module and operator, and ``convbn bench --timeline PATH`` plots it.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn

import convbn
from convbn.memory import PHASES, Timeline, tensor_peak, timeline


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )


def _models():
    torch.manual_seed(0)
    base = _net()
    x = torch.randn(4, 3, 12, 12)
    return {
        "eager": copy.deepcopy(base),
        "auto": convbn.convert(copy.deepcopy(base), example_inputs=x),
        "recompute_bn": convbn.convert(copy.deepcopy(base), strategy="recompute_bn"),
    }, x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


@pytest.mark.parametrize("name", ["eager", "auto", "recompute_bn"])
def test_timeline_max_equals_tensor_peak(name):
    models, x = _models()
    model = models[name]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model(x)).backward()
        opt.step()

    step()  # gradients exist from here on, as in training
    opt.zero_grad(set_to_none=True)  # the step's peak is above what is live after zero_grad
    with tensor_peak(model, opt) as tp:
        step()
    tl = timeline(model, x, loss_fn=_loss, optimizer=opt)
    assert tl.source == "tensors"
    assert tp.result.peak > 0
    assert tl.peak == tp.result.peak
    opt.zero_grad(set_to_none=True)
    with tensor_peak(model, opt) as again:  # and the timeline changed nothing the next step sees
        step()
    assert again.result.peak == tp.result.peak


def test_timeline_points_carry_phase_module_and_op():
    models, x = _models()
    model = models["auto"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tl = timeline(model, x, loss_fn=_loss, optimizer=opt, label="auto")
    phases = [p.phase for p in tl.points]
    # phases in step order, each present
    order = [PHASES.index(p) for p in phases]
    assert order == sorted(order)
    assert set(phases) == set(PHASES)
    assert tl.points[0].bytes == 0 and tl.points[0].op == "start"
    fwd_modules = {p.module for p in tl.points if p.phase == "forward"}
    assert any(m.startswith("convbn_chain") for m in fwd_modules)
    bwd_ops = [p.op for p in tl.points if p.phase == "backward"]
    assert any(op.startswith("ChainFunctionBackward/") for op in bwd_ops)
    assert tl.peak_point.bytes == tl.peak == max(tl.phase_peaks().values())
    assert tl.peak_point.phase in tl.where() and tl.label == "auto"
    # the optimizer step frees nothing and allocates nothing lasting for plain SGD
    assert tl.points[-1].phase == "optimizer"


def test_timeline_default_loss_and_errors():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    tl = timeline(model, torch.randn(4, 8))
    assert {p.phase for p in tl.points} <= {"forward", "loss", "backward"}
    assert tl.peak > 0
    assert model[0].weight.grad is not None
    with pytest.raises(TypeError, match="nn.Module"):
        timeline(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tensor output"):
        timeline(_Const(), torch.randn(2))


class _Const(nn.Module):
    def forward(self, x):
        return "not a tensor"


def test_plot_timelines_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from convbn.bench.timeline import plot_timelines, record_timelines

    torch.manual_seed(0)
    tls = record_timelines(_net(), torch.randn(4, 3, 12, 12),
                           ["eager", "convert auto", "convert recompute_conv (tutorial)"])
    assert [t.label for t in tls] == ["eager", "convert auto", "convert recompute_conv (tutorial)"]
    assert all(isinstance(t, Timeline) and t.peak > 0 for t in tls)
    path = tmp_path / "tl.png"
    plot_timelines(tls, str(path), title="small")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one"):
        plot_timelines([], str(path))
    with pytest.raises(ValueError, match="must be among"):
        record_timelines(_net(), torch.randn(4, 3, 12, 12), ["nope"])


def test_timeline_legend_is_in_plain_words(tmp_path):
    """The legend names fused chains by the layers they fuse and phases by name, never by
    convbn's internal module / Function names."""
    pytest.importorskip("matplotlib")
    from convbn import convert
    from convbn.bench.timeline import describe_point, plot_timelines
    from convbn.memory import timeline

    torch.manual_seed(0)
    x = torch.randn(4, 3, 12, 12)
    eager = _net().train()
    fused = convert(copy.deepcopy(eager), strategy="recompute_conv")
    tls = [timeline(eager, x, label="unfused"), timeline(fused, x, label="convert")]
    legend = plot_timelines(tls, str(tmp_path / "tl.png"), models=[eager, fused])
    text = " ".join(legend)
    assert "convbn_chain" not in text and "ChainFunction" not in text, legend
    assert legend[1].startswith("convert: peak ") and "x unfused's peak" in legend[1]
    chain_points = [p for p in tls[1].points if p.module.startswith("convbn_chain")]
    assert chain_points
    described = describe_point(chain_points[-1], fused)
    assert "fused layers" in described and "convbn_chain" not in described, described
    assert "fused chain 1" in describe_point(chain_points[-1])  # without the model: numbered, counted from 1


def test_bench_timeline_option_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import argparse

    from convbn.bench.training import add_training_arguments, main_training

    path = tmp_path / "mnist.png"
    args = add_training_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", "mnist", "--batch-size", "4", "--steps", "1", "--warmup", "0", "--memory-rounds", "1",
         "--no-compile", "--configs", "eager,auto", "--no-progress", "--timeline", str(path)]
    )
    assert main_training(args) == 0
    assert os.path.getsize(path) > 1000
    out = capsys.readouterr().out
    assert "timeline mnist convert auto: peak" in out and f"timeline written to {path}" in out
