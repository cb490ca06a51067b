"""MONAI ``UpCat``'s pattern (issue 39): ``torch.jit.isinstance`` asked of the skip, a pad whose
widths compare shapes (all zero at even sizes), a concatenation.

* ``torch.jit.isinstance`` on traced values is answered from their types (Note: [torch.jit.isinstance
  answered from types] in tracing/hazards.py), so ``convert`` traces the block whole with the real
  shapes, drops the zero-width pad and hands the concatenation's pieces to the chain;
* ``fold`` keeps the block's own code (shape-generic) and folds its children one by one (Note: [fold
  prefers the shape-generic graph] in fold/generic.py), so a folded model still exports with dynamic
  batch and spatial sizes.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn import deploy
from convbn.passes.tracing.trace import TraceHazard, trace
from fusion_checks import assert_chain_ran

TOL = dict(rtol=1e-10, atol=1e-10)


class UpCat(nn.Module):
    """``monai.networks.nets.basic_unet.UpCat.forward``, written again (3-D)."""

    def __init__(self, cin: int, cskip: int, cout: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.upsample = nn.ConvTranspose3d(cin, cin, 2, stride=2)
        self.convs = nn.Sequential(nn.Conv3d(cin + cskip, cout, 3, padding=1), norm(cout), nn.LeakyReLU(0.1),
                                   nn.Conv3d(cout, cout, 3, padding=1), norm(cout), nn.LeakyReLU(0.1))

    def forward(self, x: Tensor, x_e: Optional[Tensor]) -> Tensor:
        x_0 = self.upsample(x)
        if x_e is not None and torch.jit.isinstance(x_e, torch.Tensor):
            dimensions = len(x.shape) - 2
            sp = [0] * (dimensions * 2)
            for i in range(dimensions):
                if x_e.shape[-i - 1] != x_0.shape[-i - 1]:
                    sp[i * 2 + 1] = 1
            x_0 = F.pad(x_0, sp, "replicate")
            return self.convs(torch.cat([x_e, x_0], dim=1))
        return self.convs(x_0)


def _block(cin: int, cout: int, norm: Callable[[int], nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), norm(cout), nn.LeakyReLU(0.1))


class TinyBasicUNet(nn.Module):
    """One level of MONAI's ``BasicUNet``: encoder block, pooled block, ``UpCat``, 1x1 head."""

    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.enc = _block(1, 4, norm)
        self.pool = nn.MaxPool3d(2)
        self.down = _block(4, 8, norm)
        self.up = UpCat(8, 4, 4, norm)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        e = self.enc(x)
        return self.head(self.up(self.down(self.pool(e)), e))


def _instance(c: int) -> nn.Module:
    return nn.InstanceNorm3d(c, affine=True, track_running_stats=True)


NORMS = ["enc.1", "down.1", "up.convs.1", "up.convs.4"]


def _pads(model: nn.Module) -> List[str]:
    """The ``F.pad`` calls left in the graphs installed in ``model``."""
    found = []
    for name, m in model.named_modules():
        graph = getattr(m.__dict__.get("forward"), "graph", None)
        found += [f"{name}:{n.name}" for n in (graph.nodes if graph is not None else ())
                  if n.op == "call_function" and n.target is F.pad]
    return found


@pytest.mark.parametrize("with_inputs", [True, False])
def test_upcat_pattern_converts_fused_and_exact(with_inputs: bool) -> None:
    torch.manual_seed(0)
    eager = TinyBasicUNet(_instance).double()
    fast = copy.deepcopy(eager)
    x = torch.randn(2, 1, 8, 8, 8, dtype=torch.float64)
    fast = convbn.convert(fast, example_inputs=x.clone() if with_inputs else None)
    for step in range(2):  # the first call captures without example_inputs; the second runs the capture
        out_e, out_f = eager(x), fast(x)
        assert_chain_ran(out_f)
        (out_e * torch.linspace(-1, 1, out_e.numel(), dtype=x.dtype).view_as(out_e)).sum().backward()
        (out_f * torch.linspace(-1, 1, out_f.numel(), dtype=x.dtype).view_as(out_f)).sum().backward()
        torch.testing.assert_close(out_f, out_e, **TOL)
        for (name, pe), (_, pf) in zip(eager.named_parameters(), fast.named_parameters()):
            torch.testing.assert_close(pf.grad, pe.grad, **TOL, msg=lambda m: f"{name}: {m}")
        for (name, be), (_, bf) in zip(eager.named_buffers(), fast.named_buffers()):
            torch.testing.assert_close(bf, be, **TOL, msg=lambda m: f"{name}: {m}")
        eager.zero_grad(set_to_none=True)
        fast.zero_grad(set_to_none=True)
    report = fast.convbn_report
    assert sorted(p.bn for p in report.pairs) == sorted(NORMS), report  # UpCat's two norms among them
    up = {p.chain for p in report.pairs if p.bn.startswith("up.")}
    assert len(up) == 1 and sorted(p.conv for p in report.pairs if p.chain in up) == ["up.convs.0", "up.convs.3"]
    assert not any(name == "up" or name.startswith("up.") for name, _ in report.untraced), report.untraced
    assert not _pads(fast), _pads(fast)  # the zero-width pad read by the concatenation is gone


def _question_module(question: Callable[[Tensor, Tensor], bool]) -> nn.Module:
    class Asks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: Tensor) -> Tensor:
            y = self.a(x)
            z = y.relu()
            return y - z if question(y, z) else y * 2

    return Asks()


QUESTIONS: Dict[str, Tuple[Callable[[Tensor, Tensor], bool], bool]] = {
    "Tensor": (lambda y, z: torch.jit.isinstance(y, torch.Tensor), True),
    "Optional[Tensor]": (lambda y, z: torch.jit.isinstance(y, Optional[torch.Tensor]), True),
    "List[Tensor]": (lambda y, z: torch.jit.isinstance([y, z], List[torch.Tensor]), True),
    "Tuple[Tensor, Tensor]": (lambda y, z: torch.jit.isinstance((y, z), Tuple[torch.Tensor, torch.Tensor]), True),
    "Dict[str, Tensor]": (lambda y, z: torch.jit.isinstance({"y": y}, Dict[str, torch.Tensor]), True),
    "List[int] of tensors": (lambda y, z: torch.jit.isinstance([y, z], List[int]), False),
    "a tensor as List[Tensor]": (lambda y, z: torch.jit.isinstance(y, List[torch.Tensor]), False),
    "Tuple of three": (lambda y, z: torch.jit.isinstance((y, z), Tuple[torch.Tensor, torch.Tensor, torch.Tensor]),
                       False),
}


@pytest.mark.parametrize("name", list(QUESTIONS))
def test_jit_isinstance_on_computed_tensors_is_answered_without_shapes(name: str) -> None:
    question, answer = QUESTIONS[name]
    torch.manual_seed(0)
    model = _question_module(question)
    x = torch.randn(2, 3, 5, 5)
    y = model.a(x)
    assert question(y, y.relu()) is answer  # eager's answer
    traced = trace(model)  # symbolic: no example, so no shape is known to the trace
    assert not traced.opaque and traced.shapes is None
    torch.testing.assert_close(traced.gm(x), model(x), rtol=0, atol=0)
    other = torch.randn(3, 3, 7, 4)
    torch.testing.assert_close(traced.gm(other), model(other), rtol=0, atol=0)


def test_jit_isinstance_on_an_input_a_symbolic_trace_cannot_know_is_a_hazard() -> None:
    class AskInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: Tensor, skip: Any) -> Tensor:
            y = self.a(x)
            if torch.jit.isinstance([y, skip], List[torch.Tensor]):  # skip: an int in eager, say
                y = y + skip
            return y

    with pytest.raises(TraceHazard, match=r"torch\.jit\.isinstance\(\) on a traced value at test_upcat_pattern\.py"):
        trace(AskInputs())


class ReturnsDict(nn.Module):
    """Opaque to ``torch.fx`` (a branch on data), returning a dict: its output is no tensor."""

    def forward(self, x: Tensor) -> Any:
        return {"y": x} if float(x.detach().abs().sum()) >= 0 else {"y": -x}


class AsksOfADict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.features = ReturnsDict()

    def forward(self, x: Tensor) -> Tensor:
        out = self.features(self.a(x))
        if torch.jit.isinstance(out, Dict[str, torch.Tensor]):  # True in eager
            out = out["y"]
        return out * 2


def test_jit_isinstance_on_what_an_opaque_module_returned_is_a_hazard() -> None:
    with pytest.raises(TraceHazard, match=r"torch\.jit\.isinstance"):
        trace(AsksOfADict())
    model = AsksOfADict()
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(convbn.fold(copy.deepcopy(model).eval(), example_inputs=x)(x), model.eval()(x))


def _randomize_bn(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm3d):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


def test_folded_upcat_pattern_exports_with_dynamic_batch_and_spatial_sizes() -> None:
    torch.manual_seed(0)
    model = _randomize_bn(TinyBasicUNet(nn.BatchNorm3d).eval())
    folded = convbn.fold(copy.deepcopy(model), example_inputs=torch.randn(2, 1, 8, 8, 8))
    report = folded.convbn_report
    assert sorted(o.batchnorm for o in report.folded) == sorted(NORMS), report  # UpCat's BatchNorms folded, in its children
    assert any(name == "up" and "shape-generic" in why for name, why in report.untraced), report.untraced
    assert folded.up.__dict__.get("forward") is None  # UpCat runs its own code, not a graph traced at 8^3
    program = deploy.export_program(folded, torch.randn(2, 1, 8, 8, 8), dynamic_axes="batch,spatial")
    inputs = [torch.randn(2, 1, 8, 8, 8), torch.randn(3, 1, 12, 16, 8), torch.randn(1, 1, 4, 4, 4)]
    assert max(deploy.check_program(program, model, inputs)) < 1e-5  # against the unfolded model
    assert max(deploy.check_program(program, folded, inputs)) < 1e-5


@pytest.mark.slow
def test_real_monai_basicunet_3d_traces_its_upcats_whole_and_stays_exact() -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    eager = nets.BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 8, 4)).double()
    x = torch.randn(1, 1, 32, 32, 32, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x.clone())
    report = fast.convbn_report
    assert not report.untraced, report.untraced  # the four UpCats were trace hazards before
    assert sum(p.bn.startswith("upcat_") for p in report.pairs) == 8, report
    assert not _pads(fast), _pads(fast)
    grad = torch.randn(1, 2, 32, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out_e, out_f = eager(x), fast(x)
    assert_chain_ran(out_f)
    out_e.backward(grad)
    out_f.backward(grad)
    torch.testing.assert_close(out_f, out_e, **TOL)
    for (name, pe), pf in zip(eager.named_parameters(), fast.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
