"""``convbn.convert`` on element-wise tails, pre-activation heads and chain ends (issue 10 items 2, 3, 6).

Every pattern is written the ways real code writes it (module, ``F.*``, ``torch.*``, tensor
method, in place), fused (the report's rows and tail labels are asserted, so a pattern that
silently stops fusing fails), and compared with eager PyTorch in float64 at 1e-10 over two
training steps with random upstream gradients under the same seed (dropout included):
outputs, input and parameter gradients (PReLU weights too), running stats, counters.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn import FusedChain
from test_convert import assert_same_training, build, called_modules, convert_pair, fused, inp

STRATEGIES = ("recompute_bn", "recompute_conv")


class ConvBNTail(nn.Module):
    """conv -> BN -> ``tail(self, z)`` -> conv -> BN -> ``tail`` (two layers, one chain)."""

    def __init__(self, tail: Callable[[nn.Module, Tensor], Tensor], modules: Dict[str, Callable[[], nn.Module]]) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.t1 = nn.ModuleDict({k: f() for k, f in modules.items()})
        self.t2 = nn.ModuleDict({k: f() for k, f in modules.items()})
        self.tail = tail

    def forward(self, x: Tensor) -> Tensor:
        x = self.tail(self.t1, self.b1(self.c1(x)))
        return self.tail(self.t2, self.b2(self.c2(x)))


# name: (tail(modules, z), {module name: factory}, expected tail label)
TAILS: Dict[str, Tuple[Callable[[nn.Module, Tensor], Tensor], Dict[str, Callable[[], nn.Module]], str]] = {
    "F.relu(inplace)": (lambda m, z: F.relu(z, inplace=True), {}, "relu"),
    "torch.relu_": (lambda m, z: torch.relu_(z), {}, "relu"),
    "method.relu_": (lambda m, z: z.relu_(), {}, "relu"),
    "F.leaky_relu_": (lambda m, z: F.leaky_relu_(z, 0.2), {}, "leaky_relu(0.2)"),
    "F.elu(0.5)": (lambda m, z: F.elu(z, 0.5), {}, "elu(0.5)"),
    "torch.celu": (lambda m, z: torch.celu(z, 2.0), {}, "celu(2.0)"),
    "torch.selu_": (lambda m, z: torch.selu_(z), {}, "selu"),
    "F.mish": (lambda m, z: F.mish(z), {}, "mish"),
    "F.softplus(2,10)": (lambda m, z: F.softplus(z, 2.0, 10.0), {}, "softplus(2.0, 10.0)"),
    "F.gelu(tanh)": (lambda m, z: F.gelu(z, approximate="tanh"), {}, "gelu(tanh)"),
    "F.hardtanh_(0,6)": (lambda m, z: F.hardtanh_(z, 0.0, 6.0), {}, "relu6"),
    "method.sigmoid": (lambda m, z: z.sigmoid(), {}, "sigmoid"),
    "torch.tanh": (lambda m, z: torch.tanh(z), {}, "tanh"),
    "swish": (lambda m, z: z * torch.sigmoid(z), {}, "silu"),
    "Hardsigmoid module": (lambda m, z: m["a"](z), {"a": nn.Hardsigmoid}, "hardsigmoid"),
    "PReLU": (lambda m, z: m["a"](z), {"a": nn.PReLU}, "prelu"),
    "PReLU per channel": (lambda m, z: m["a"](z), {"a": lambda: nn.PReLU(4, init=0.1)}, "prelu(4)"),
    "Dropout->PReLU": (lambda m, z: m["a"](m["d"](z)), {"d": lambda: nn.Dropout(0.3), "a": nn.PReLU},
                       "dropout(0.3) -> prelu"),
    "ReLU->Dropout2d": (lambda m, z: m["d"](m["a"](z)), {"a": lambda: nn.ReLU(inplace=True), "d": lambda: nn.Dropout2d(0.25)},
                        "relu -> dropout2d(0.25)"),
    "AlphaDropout->SELU": (lambda m, z: m["a"](m["d"](z)), {"d": lambda: nn.AlphaDropout(0.2), "a": nn.SELU},
                           "alpha_dropout(0.2) -> selu"),
    "FeatureAlphaDropout": (lambda m, z: m["d"](z), {"d": lambda: nn.FeatureAlphaDropout(0.2)},
                            "feature_alpha_dropout(0.2)"),
    "Dropout(p=0)->ReLU": (lambda m, z: m["a"](m["d"](z)), {"d": lambda: nn.Dropout(0.0), "a": nn.ReLU},
                           "dropout(0.0) -> relu"),
    "F.dropout(training=self.training)->relu": (lambda m, z: F.relu(F.dropout(z, 0.2, m.training)), {},
                                                "dropout(0.2) -> relu"),
    "F.dropout2d->gelu->F.alpha_dropout": (
        lambda m, z: F.alpha_dropout(F.gelu(F.dropout2d(z, p=0.1, training=True)), 0.3, True), {},
        "dropout2d(0.1) -> gelu -> alpha_dropout(0.3)"),
    "Identity->ReLU": (lambda m, z: m["a"](m["i"](z)), {"i": nn.Identity, "a": nn.ReLU}, "identity -> relu"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(TAILS))
def test_tail_fused_exactly(name: str, strategy: str) -> None:
    tail, modules, label = TAILS[name]
    eager, fast = convert_pair(lambda: ConvBNTail(tail, modules), strategy=strategy)
    assert fused(fast.convbn_report) == [("c1", "b1", label), ("c2", "b2", label)], fast.convbn_report
    assert called_modules(fast) == ["convbn_chain0"]  # one chain, no tail op left in the graph
    assert_same_training(eager, fast, inp(2, 3, 6, 6))
    eager.eval(), fast.eval()  # eval: dropouts are identities (a mode-dependent graph runs eager code)
    assert_same_training(eager, fast, inp(2, 3, 6, 6), steps=1)


def test_prelu_weight_gradient_is_exact() -> None:
    eager, fast = convert_pair(lambda: ConvBNTail(lambda m, z: m["a"](z), {"a": lambda: nn.PReLU(4, init=-0.3)}),
                               strategy="recompute_conv")
    assert fused(fast.convbn_report)[1][2] == "prelu(4)"
    x = inp(2, 3, 6, 6)
    g = {}
    for model in (eager, fast):
        model(x).pow(2).sum().backward()
        g[model] = (model.t1["a"].weight.grad.clone(), model.t2["a"].weight.grad.clone())
    for a, b in zip(g[eager], g[fast]):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- pre-activation


class PreActBlock(nn.Module):
    """PreAct-ResNet basic block: BN -> ReLU -> conv -> BN -> ReLU -> conv, plus identity."""

    def __init__(self, c: int = 4, drop: float = 0.0) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(self.drop(F.relu(self.bn2(out))))
        return out + x


class DenseLayer(nn.Module):
    """DenseNet-BC layer: cat -> BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv."""

    def __init__(self, cin: int, growth: int = 3) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, feats: List[Tensor]) -> Tensor:
        x = torch.cat(feats, 1)
        return self.conv2(self.relu(self.norm2(self.conv1(self.relu(self.norm1(x))))))

    relu = staticmethod(lambda t: F.relu(t, inplace=True))


class TinyDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layers = nn.ModuleList([DenseLayer(4), DenseLayer(7)])
        self.norm = nn.BatchNorm2d(10)

    def forward(self, x: Tensor) -> Tensor:
        feats = [self.stem(x)]
        for layer in self.layers:
            feats.append(layer(feats))
        return F.relu(self.norm(torch.cat(feats, 1))).mean((2, 3))


@pytest.mark.parametrize("strategy", STRATEGIES + ("auto",))
def test_preact_block_is_one_chain(strategy: str) -> None:
    eager, fast = convert_pair(lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), PreActBlock(), PreActBlock(drop=0.2)),
                               strategy=strategy)
    report = fast.convbn_report
    rows = [(p.kind, p.conv, p.bn, p.activation, p.chain, p.position) for p in report.pairs]
    assert rows == [
        ("head", "", "1.bn1", "relu", 0, 0), ("layer", "1.conv1", "1.bn2", "relu -> dropout(0.0)", 0, 1), ("end", "1.conv2", "", "identity", 0, 2),
        ("head", "", "2.bn1", "relu", 1, 0), ("layer", "2.conv1", "2.bn2", "relu -> dropout(0.2)", 1, 1),
        ("end", "2.conv2", "", "identity", 1, 2),
    ], report
    assert not report.skipped
    chains = [m for _, m in convbn.fused_modules(fast) if isinstance(m, FusedChain)]
    assert [(l.is_head, l.is_end) for l in chains[0].layers] == [(True, False), (False, False), (False, True)]
    text = str(report)
    assert "- (pre-act head)" in text and "- (chain end)" in text
    assert_same_training(eager, fast, inp(2, 3, 6, 6))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dense_layers_head_after_concatenation(strategy: str) -> None:
    eager, fast = convert_pair(TinyDense, strategy=strategy)
    report = fast.convbn_report
    kinds = [(p.kind, p.bn or p.conv) for p in report.pairs]
    assert kinds == [("head", "layers.0.norm1"), ("layer", "layers.0.norm2"), ("end", "layers.0.conv2"),
                     ("head", "layers.1.norm1"), ("layer", "layers.1.norm2"), ("end", "layers.1.conv2")], report
    # the last BN reads a concatenation and feeds a pooling: nothing to fuse, and the report says why
    (skip,) = report.skipped
    assert skip.bn == "norm" and "not a convolution output" in skip.reason and "mean" in skip.reason
    assert_same_training(eager, fast, inp(2, 3, 6, 6))


def test_preact_saves_memory() -> None:
    """A pre-activation chain keeps x0 and the middle conv output only (recompute_bn)."""
    eager = build(lambda: nn.Sequential(PreActBlock(8), PreActBlock(8)))
    x = inp(4, 8, 8, 8)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=x)
    rep = fast.convbn_report
    assert len(rep.pairs) == 6 and rep.saved_bytes < 0.6 * rep.eager_saved_bytes, rep


# --------------------------------------------------------------------------- reasons a user can act on


class HeadIntoMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.b0 = nn.BatchNorm2d(3)

    def forward(self, x: Tensor) -> Tensor:
        z = F.relu(self.b(self.c(x)))
        # b0 reads the input (no conv) and its tail ends in a multiplication, not a conv
        h = torch.dropout(F.relu(self.b0(x)), 0.1, True) * x.abs().mean()
        return self.c2(z).mean() + h.mean()


def test_reasons_name_the_op_and_why() -> None:
    eager, fast = convert_pair(HeadIntoMul, strategy="recompute_bn")
    report = fast.convbn_report
    assert [(p.bn, p.activation) for p in report.pairs] == [("b", "relu"), ("", "identity")]
    (skip,) = report.skipped
    assert skip.bn == "b0"
    assert "not a convolution output" in skip.reason and "pre-activation" in skip.reason
    assert "after relu -> dropout(0.1), function mul reads the value, not a convolution" in skip.reason, skip.reason
    assert_same_training(eager, fast, inp(2, 3, 6, 6))


class ActThenAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.c = nn.BatchNorm2d(3), nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        a = F.relu(self.b(x))
        return self.c(a) + a  # the activation's output is read twice: no head


@pytest.mark.expect_unfused("a head whose output other ops read is left unfused")
def test_head_needs_conv_as_only_reader() -> None:
    eager, fast = convert_pair(ActThenAdd, strategy="recompute_bn")
    (skip,) = fast.convbn_report.skipped
    assert "after relu, the value is read by module 'c', function add" in skip.reason, skip.reason
    assert not fast.convbn_report.pairs


def test_no_heads_without_chains() -> None:
    eager, fast = convert_pair(lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), PreActBlock()),
                               strategy="recompute_bn", chain=False)
    report = fast.convbn_report
    assert [p.bn for p in report.pairs] == ["1.bn2"]  # conv1 -> bn2 -> relu, alone
    assert any(s.bn == "1.bn1" and "chain=True" in s.reason for s in report.skipped), report
    assert_same_training(eager, fast, inp(2, 3, 6, 6))


def test_hooked_tail_module_left_unfused() -> None:
    def factory() -> nn.Module:
        m = ConvBNTail(lambda m, z: m["a"](z), {"a": nn.PReLU})
        m.t2["a"].register_forward_hook(lambda mod, i, o: None)
        return m

    eager, fast = convert_pair(factory, strategy="recompute_bn")
    assert [p.bn for p in fast.convbn_report.pairs] == ["b1"]
    (skip,) = fast.convbn_report.skipped
    assert skip.bn == "b2" and "'t2.a' has hooks" in skip.reason
    assert_same_training(eager, fast, inp(2, 3, 6, 6))


def test_hook_on_tail_module_after_convert_runs() -> None:
    eager, fast = convert_pair(lambda: ConvBNTail(lambda m, z: m["d"](z), {"d": lambda: nn.Dropout(0.5)}),
                               strategy="recompute_bn")
    seen = []
    fast.t1["d"].register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    eager.t1["d"].register_forward_hook(lambda mod, i, o: None)
    assert_same_training(eager, fast, inp(2, 3, 6, 6))
    assert len(seen) == 2


class HeadThroughFunctionalPReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.c = nn.BatchNorm2d(3), nn.Conv2d(3, 3, 3, padding=1)
        self.w = nn.Parameter(torch.full((1,), 0.25))

    def forward(self, x: Tensor) -> Tensor:
        return self.c(F.prelu(self.b(x), self.w))


class HeadThroughClamp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.c = nn.BatchNorm2d(3), nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.clamp(self.b(x), 0.0, 6.0))


@pytest.mark.parametrize("factory, words", [(HeadThroughFunctionalPReLU, "use nn.PReLU"),
                                            (HeadThroughClamp, "use F.relu6 / nn.ReLU6")])
@pytest.mark.expect_unfused("unsupported tails are left unfused with the fix named")
def test_unsupported_elementwise_op_is_named_with_the_fix(factory: Callable[[], nn.Module], words: str) -> None:
    eager, fast = convert_pair(factory, strategy="recompute_bn")
    (skip,) = fast.convbn_report.skipped
    assert "the element-wise ops stop at function" in skip.reason and words in skip.reason, skip.reason
    assert not fast.convbn_report.pairs
    assert_same_training(eager, fast, inp(2, 3, 6, 6))
