"""Channel RMSNorm, one row of the norm table (issue 39): every spelling seen in diffusion U-Nets
fuses in Conv -> RMSNorm -> act chains and in the pre-activation order, computing the spelling's
own ops (Note: [an RMSNorm spelling is its own form] in passes/bn/hand_rms_norms.py), exact
against eager in float64 (outputs, every gradient), bit for bit in float32 forward; look-alikes
stay as written; fold says why it cannot fold; the row deleted, nothing is recognised.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
import convbn.functional.norms as norms
from capture_helpers import assert_steps_match
from convbn.autograd.norm_chain import NormLayerSpec
from convbn.functional.activations import Activation
from convbn.functional.conv import conv_spec_from_module
from convbn.functional.norms import NORMS, NormCall, channel_rms_norm
from fusion_checks import assert_fused
from norm_chain_checks import assert_chain_function_checks


class NormalizeGS(nn.Module):
    """denoising-diffusion-pytorch's ``RMSNorm``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale, self.g = dim ** 0.5, nn.Parameter(torch.rand(1, dim, 1, 1) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * self.g * self.scale


class NormalizeSG(nn.Module):
    """imagen's ``ChanRMSNorm``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale, self.gamma = dim ** 0.5, nn.Parameter(torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma


class NormalizeShape(nn.Module):
    """denoising-diffusion-pytorch's ``Unet1D`` ``RMSNorm`` (the scale read off the shape), on 4-D."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(1, dim, 1, 1) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * self.g * (x.shape[1] ** 0.5)


class NormalizeEinsum(nn.Module):
    """x-unet's ``RMSNorm``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale, self.gamma = dim ** 0.5, nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("b c ..., c -> b c ...", F.normalize(x, dim=1) * self.scale, self.gamma)


class Rsqrt(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * self.w[:, None, None]


class Sqrt(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(1, dim, 1, 1) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.w * (x / torch.sqrt(torch.mean(x * x, dim=1, keepdim=True) + 1e-5))


class Permuted(nn.Module):
    """torch's ``nn.RMSNorm`` over the last dimension between permutes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PermutedFunctional(nn.Module):
    """``F.rms_norm`` between permutes, eps left to torch (the dtype's machine epsilon)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim, self.weight = dim, nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.permute(0, 2, 3, 1), (self.dim,), self.weight).permute(0, 3, 1, 2)


SPELLINGS: Dict[str, Callable[[int], nn.Module]] = {
    "normalize_gs": NormalizeGS, "normalize_sg": NormalizeSG, "normalize_shape": NormalizeShape,
    "normalize_einsum": NormalizeEinsum, "rsqrt": Rsqrt, "sqrt": Sqrt, "rms_norm": Permuted,
    "rms_norm_functional": PermutedFunctional,
}
FORMS = {"normalize_shape": "normalize_gs", "normalize_einsum": "normalize_sg", "rms_norm_functional": "rms_norm"}


def _post(norm: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.ReLU(), nn.Conv2d(8, 4, 1))


class PreAct(nn.Module):
    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.n1, self.c1 = norm(4), nn.Conv2d(4, 8, 3, padding=1)
        self.n2, self.c2 = norm(8), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))


def _forms(fast: nn.Module) -> set:
    return {l.bn.call().form for _, m in convbn.fused_modules(fast) for l in getattr(m, "layers", ())
            if l.bn is not None}


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_spelling_fuses_exact_against_eager(spelling: str, strategy: str) -> None:
    """Conv -> RMSNorm -> act: fused (both norms, in one chain that ran), outputs and every
    gradient eager's in float64 over two steps, the spelling's own form."""
    torch.manual_seed(0)
    eager = _post(SPELLINGS[spelling]).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy=strategy)
    report = assert_fused(fast, pairs=3)
    assert [p.activation for p in report.pairs][:2] == ["silu", "relu"]
    assert _forms(fast) == {FORMS.get(spelling, spelling)}
    assert_steps_match(eager, fast, torch.randn(2, 3, 6, 6, dtype=torch.float64))


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_spelling_runs_its_own_ops_bit_for_bit(spelling: str) -> None:
    """float32: the converted forward is the model's own code's bit for bit (a form computed by
    another spelling's ops rounds differently and fails here)."""
    torch.manual_seed(0)
    eager = _post(SPELLINGS[spelling])
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(fast(x), eager(x))


@pytest.mark.parametrize("spelling", ["normalize_gs", "rsqrt", "rms_norm"])
def test_pre_activation_order_fuses(spelling: str) -> None:
    torch.manual_seed(0)
    eager = PreAct(SPELLINGS[spelling]).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    report = assert_fused(fast)
    assert {p.bn.split(".")[0] for p in report.pairs} >= {"n1", "n2"}
    assert_steps_match(eager, fast, torch.randn(2, 4, 6, 6, dtype=torch.float64))


def test_normalize_clamps_the_norm_where_the_others_add_eps() -> None:
    """``F.normalize`` is ``x / max(||x||, eps)``: at a position of tiny values the forms differ by
    orders of magnitude, and the converted model computes the spelling's (an ``F.normalize`` taken
    as ``rsqrt(mean(x^2) + eps)`` fails here)."""
    torch.manual_seed(0)
    eager = _post(NormalizeGS).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    with torch.no_grad():
        x = torch.randn(2, 8, 5, 5, dtype=torch.float64) * 1e-9
        y = fast[1](x)  # the norm module alone still runs its own code; the node is the chain's
        call = NormCall("channel_rms_norm", 1e-12, normalized=(8,), form="normalize_gs", scale=8 ** 0.5)
        node = norms.norm_forward(x, call, eager[1].g, None)
        assert torch.equal(node, y)
        other = norms.norm_forward(x, NormCall("channel_rms_norm", 1e-12, normalized=(8,), form="rsqrt"),
                                   eager[1].g, None)
        assert not torch.allclose(other, y, rtol=1e-3, atol=0)
    xs = torch.randn(2, 3, 6, 6, dtype=torch.float64) * 1e-9
    assert_steps_match(eager, fast, xs)


def test_chain_function_gradcheck_and_gradgradcheck() -> None:
    """float64 gradcheck and gradgradcheck of a chain with RMSNorm layers (two forms), recomputing
    one conv output and keeping the other."""
    c1, c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
    specs = (NormLayerSpec(conv_spec_from_module(c1), NormCall("channel_rms_norm", 1e-12, normalized=(4,),
                                                                form="normalize_gs", scale=2.0),
                           Activation("silu"), keep_y=False),
             NormLayerSpec(conv_spec_from_module(c2), NormCall("channel_rms_norm", 1e-6, normalized=(4,), form="rsqrt"),
                           Activation("relu")),
             NormLayerSpec(conv_spec_from_module(nn.Conv2d(4, 2, 1)), None, Activation("identity")))
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()

    params = [t(4, 3, 3, 3), t(4), t(1, 4, 1, 1), None, t(4, 4, 3, 3), t(4), t(4), None, t(2, 4, 1, 1), t(2)]
    x = t(2, 3, 4, 4)
    assert_chain_function_checks(x, params, specs)


class NormalizeRows(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=-1) * self.g


class NormalizeL1(NormalizeRows):
    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, p=1.0, dim=1) * self.g


class NoGain(NormalizeRows):
    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * 2.0


class Centred(NormalizeRows):
    """Not an RMSNorm: the mean square of the centred input (a LayerNorm without its bias, left
    to the LayerNorm rewrite) over dim 2."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(2, keepdim=True) + 1e-6) * self.g


class SpatialGain(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(6))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * self.g


@pytest.mark.expect_unfused("look-alikes of an RMSNorm: nothing to fuse")
@pytest.mark.parametrize("norm", [NormalizeRows, NormalizeL1, NoGain, Centred, SpatialGain],
                         ids=lambda c: c.__name__)
def test_look_alikes_are_left_as_written(norm: Callable[[int], nn.Module]) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.SiLU()).double()
    fast = convbn.convert(copy.deepcopy(eager))
    assert not fast.convbn_report.pairs
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    assert torch.equal(fast(x), eager(x))


@pytest.mark.expect_unfused("the RMSNorm row is deleted: nothing to fuse")
@pytest.mark.parametrize("spelling", ["normalize_gs", "rsqrt", "rms_norm"])
def test_deleted_row_is_recognised_nowhere(monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    eager = _post(SPELLINGS[spelling])
    monkeypatch.setattr(norms, "NORMS", [r for r in NORMS if r.name != "channel_rms_norm"])
    fast = convbn.convert(copy.deepcopy(eager))
    assert not [p for p in fast.convbn_report.pairs if p.bn not in ("", None) and "1" in p.bn.split(".")[:1]]
    assert not list(convbn.fused_modules(fast))
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(fast(x), eager(x))


@pytest.mark.parametrize("spelling", ["normalize_gs", "normalize_sg", "rsqrt", "rms_norm", "rms_norm_functional"])
def test_fold_says_why_it_cannot_fold(spelling: str) -> None:
    """Each RMSNorm left in fold's report under its module's name, with the row's reason; the
    folded model computes as before."""
    torch.manual_seed(0)
    model = _post(SPELLINGS[spelling]).eval()
    x = torch.randn(2, 3, 6, 6)
    ref = model(x)
    folded = convbn.fold(copy.deepcopy(model))
    left = [o for o in folded.convbn_report.outcomes if o.batchnorm.split(".")[0] in ("1", "4")]
    assert len(left) == 2 and all(o.result == "left" for o in left)
    assert all("root mean square" in o.reason and o.reason.startswith("cannot fold") for o in left)
    assert torch.equal(folded(x), ref)


def test_explain_names_the_user_module() -> None:
    """explain's report names each RMSNorm by the user's module holding its gain and by its row."""
    torch.manual_seed(0)
    model = _post(NormalizeGS)
    report = convbn.explain(model, torch.randn(2, 3, 8, 8))
    assert [(p.conv, p.bn) for p in report.pairs][:2] == [("0", "1"), ("3", "4")]
    assert [o.result for o in report.outcomes if o.batchnorm in ("1", "4")] == ["fused", "fused"]
    assert [p.norm for p in report.pairs] == ["channel_rms_norm", "channel_rms_norm", ""]
    assert "1 (channel_rms_norm)" in str(report), report


def test_channel_rms_norm_refuses_an_unknown_form() -> None:
    with pytest.raises(ValueError, match="form must be one of"):
        channel_rms_norm(torch.randn(1, 2, 3, 3), (2,), None, 1e-6, "mean")


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("spelling", ["normalize_gs", "normalize_sg", "rsqrt", "rms_norm"])
def test_memory_model_is_the_measured_one(monkeypatch: pytest.MonkeyPatch, spelling: str, act: str,
                                          strategy: str) -> None:
    """What the chain saves is the planner's count to the byte, and its backward's replay (the
    row's ``stat_tensors`` and ``graph_maps``: the statistics its ops save and the normalised
    input its gain's gradient reads) the measured peak to the byte. A form that held a map or a
    statistics tensor more than its row says (a product by the scale beside its operand, a name
    holding the mean square) peaks above the replay under ReLU with ``recompute_conv``."""
    import test_norm_memory_model as mm
    from convbn.autograd.refcounts import frees_incoming_gradients
    from convbn.passes.plan.peak_model import chain_backward_peak

    monkeypatch.setitem(mm.NORMS, "channel_rms_norm", SPELLINGS[spelling])
    fused, chain = mm._converted("channel_rms_norm", act, strategy)
    cost, keep = mm._cost(chain)
    assert cost.norms == ("channel_rms_norm",) * 3
    x = torch.randn(8, 4, 16, 16, requires_grad=True)
    assert convbn.saved_bytes(fused, x).activation_bytes == x.numel() * 4 + cost.kept_bytes(keep)
    held = 0 if frees_incoming_gradients() else cost.y_bytes[-1]
    assert chain_backward_peak(cost, keep)[0] + held == mm._measured_backward(fused, cost, keep)


class RMSNet(nn.Module):
    """Three RMSNorm forms in one body (3 -> 8 channels, as ``test_norm_chains_compiled``'s net)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), NormalizeGS(8), nn.SiLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), Rsqrt(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), Permuted(8), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def test_rms_chains_under_bf16_autocast_and_torch_compile_match_eager() -> None:
    """bf16 autocast: the fused chain (it ran) gives eager autocast's values exactly; compiled
    (``aot_eager``, fullgraph) in float64: compiled eager's values."""
    import test_norm_chains_compiled as cc

    torch.manual_seed(0)
    eager = RMSNet()
    fast = convbn.convert(copy.deepcopy(eager))
    assert_fused(fast, pairs=3, chains=1)
    cc._assert_like(eager, eager, fast, fast, amp=True, tol=dict(rtol=0, atol=0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast(torch.randn(2, 3, 12, 12, requires_grad=True))
    assert out.dtype == torch.bfloat16 and type(out.grad_fn).__name__ == "NormChainFunctionBackward"
    eager, fast = eager.double(), fast.double()
    ce = torch.compile(eager, backend="aot_eager", fullgraph=True)
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    cc._assert_like(eager, ce, fast, cf)
