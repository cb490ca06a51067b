"""One table of activations (Note: [one table of activations] in functional/activations.py):
every record is recognised by matching (passes/convert/match_tail.py) in each spelling the
record lists, by fold's description of an activation before a layer (passes/fold/layers.py),
by the compiled kernels' coverage (autograd/chain_kernels.py) and by the memory replay
(autograd/chain_memory.py); an entry removed from the table is recognised nowhere, and an
entry added to it is recognised, fused and exact everywhere with no other edit.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import convbn
from convbn.autograd import chain_kernels, chain_memory
from convbn.functional import activations as A
from convbn.functional.batchnorm import BNSpec
from convbn.passes.convert.match_tail import match_tail
from convbn.passes.fold.layers import describe_activation
from fusion_checks import assert_fused
from test_convert import assert_same_training, inp

# (activation name, how the graph calls it: "module" / a callable / a method name, its arguments)
Spelling = Tuple[str, Any, Tuple[Any, ...]]


def spellings() -> Iterator[Spelling]:
    """Every way the table says a graph may spell each activation."""
    for name, rec in A._TABLE.items():
        for _ in rec.modules:
            yield name, "module", ()
        for f in rec.functions:
            yield name, f, tuple(d for _, _, d in rec.call_params)
        for m in rec.methods:
            yield name, m, ()
        if rec.spelling is not None:
            for f in rec.spelling.functions:
                yield name, f, rec.spelling.values


def _label(s: Spelling) -> str:
    how = s[1] if isinstance(s[1], str) else f"{getattr(s[1], '__module__', '')}.{s[1].__name__}"
    return f"{s[0]}-{how}"


SPELLINGS: List[Spelling] = list(spellings())


def graph_with(name: str, how: Any, args: Tuple[Any, ...]) -> Tuple[nn.Module, fx.Node, fx.Node]:
    """conv -> bn -> the activation spelled ``how``, as a graph built by hand (not traced: a
    spelling the tracer records differently is still matched as written). Returns the root,
    the BatchNorm's node and the activation's node."""
    root = nn.Module()
    root.conv, root.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    g = fx.Graph()
    x = g.placeholder("x")
    bn = g.call_module("bn", (g.call_module("conv", (x,)),))
    if how == "module":
        root.act = A.Activation(name).module()
        act = g.call_module("act", (bn,))
    elif isinstance(how, str):
        act = g.call_method(how, (bn,))
    else:
        act = g.call_function(how, (bn, *args))
    g.output(g.call_module("conv", (act,)))
    return root, bn, act


def _matched(name: str, how: Any, args: Tuple[Any, ...]) -> Any:
    root, bn, _ = graph_with(name, how, args)
    tail = match_tail(bn, root)
    if not tail.ops:
        return None
    e = tail.ops[0].element
    return e if isinstance(e, A.Activation) else A.activation_from_module(e)


@pytest.mark.parametrize("spelling", SPELLINGS, ids=_label)
def test_matching_recognises_every_spelling(spelling: Spelling) -> None:
    act = _matched(*spelling)
    if spelling[0] == "identity":  # a trailing identity stays in the graph (match_tail)
        assert act is None
        return
    assert act is not None and act.name == spelling[0]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=_label)
def test_fold_describes_every_spelling(spelling: Spelling) -> None:
    root, _, node = graph_with(*spelling)
    assert describe_activation(node, dict(root.named_modules()), str) is not None


def test_every_activation_has_a_graph_spelling() -> None:
    """An activation the graph cannot spell is one matching never finds."""
    assert {s[0] for s in SPELLINGS} == set(A.ACTIVATIONS)


@pytest.mark.parametrize("name", A.ACTIVATIONS)
def test_kernels_read_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(chain_kernels._STATE, "on", True)
    monkeypatch.setitem(chain_kernels._STATE, "failed", False)
    y, bn = torch.zeros(2, 4, 3, 3), BNSpec(1e-5, True, 0.1)
    rec = A._TABLE[name]
    assert chain_kernels._applies(y, bn, A.Activation(name)) == rec.fused_forward
    monkeypatch.setitem(A._TABLE, name, dataclasses.replace(rec, fused_forward=not rec.fused_forward))
    assert chain_kernels._applies(y, bn, A.Activation(name)) == (not rec.fused_forward)


@pytest.mark.parametrize("name", A.ACTIVATIONS)
def test_replay_reads_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    act = A.Activation(name)
    kind = chain_memory.activation_kind(act)
    expected = "identity" if name == "identity" else "output" if act.output_derivable else "smooth"
    assert kind == expected
    assert chain_memory.replay([8, 8], [8, 8], [False, False], [kind, kind], [False, False])[0] > 0
    if name != "identity":  # the record decides: without a derivative from the output, "smooth"
        monkeypatch.setitem(A._TABLE, name, dataclasses.replace(A._TABLE[name], backward_from_output_=None))
        assert chain_memory.activation_kind(act) == "smooth"


@pytest.mark.parametrize("name", ["mish", "relu", "relu6", "sigmoid"])
def test_an_entry_removed_is_recognised_nowhere(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: matching, fold and the module lookup have no list of their own to fall back on."""
    ours = [s for s in SPELLINGS if s[0] == name]
    assert all(_matched(*s) is not None for s in ours)
    monkeypatch.delitem(A._TABLE, name)
    for s in ours:
        root, bn, node = graph_with(*s) if s[1] != "module" else (None, None, None)
        if root is not None:
            assert not match_tail(bn, root).ops, s
            assert describe_activation(node, dict(root.named_modules()), str) is None, s
    assert A.activation_from_module(getattr(nn, {"mish": "Mish", "relu": "ReLU", "relu6": "ReLU6",
                                                 "sigmoid": "Sigmoid"}[name])()) is None


# softsign(z) = z / (1 + |z|); d/dz = 1 / (1 + |z|)^2
_SOFTSIGN = A._Record(
    lambda a, z, ip: F.softsign(z),
    lambda a, g, z: g / (1 + z.abs()).square(),
    lambda a, g, z: g / (1 + z.abs()).square(),
    (nn.Softsign,), lambda m: {}, None, lambda a: nn.Softsign(), functions=(F.softsign,))


class _SoftsignNet(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.c1, self.b1, self.a1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Softsign()
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.functional = functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a1(self.b1(self.c1(x)))
        z = self.b2(self.c2(x))
        return F.softsign(z) if self.functional else self.a1(z)


@pytest.mark.parametrize("functional", [False, True])
def test_an_entry_added_is_fused_with_no_other_edit(functional: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One record added to the table: matched (module and ``F.softsign``), replayed, run by the
    chain, and equal to eager over a training step (float64)."""
    monkeypatch.setitem(A._TABLE, "softsign", _SOFTSIGN)
    assert _matched("softsign", F.softsign, ()).name == "softsign"
    torch.manual_seed(0)
    model = _SoftsignNet(functional).double()
    eager = _SoftsignNet(functional).double()
    eager.load_state_dict(model.state_dict())
    fast = convbn.convert(model, strategy="recompute_bn")
    assert_fused(fast, pairs=2)
    assert [p.activation for p in fast.convbn_report.pairs] == ["softsign", "softsign"]
    assert_same_training(eager, fast, inp(2, 3, 6, 6))
