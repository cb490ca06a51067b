"""A ``convert`` or ``fold`` that raises leaves the model exactly as it was; fold never takes a
child away from a module the model owns.

The model's observable state is recorded before the call and compared after it: each
module's instance attributes (no rewritten ``forward``, no ``convbn_report``), its children,
parameters and buffers (the same objects, the same values, ``num_batches_tracked``
included), its hooks, and the outputs of a call.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.fx
from torch import Tensor, nn

import convbn
from convbn.passes.report.attached import detach_report
import convbn.passes.convert.api as convert_api
import convbn.passes.fold.api as fold_api


class Net(nn.Module):
    """Conv -> BN -> ReLU twice, a SyncBatchNorm (swapped by convert), a hooked head, a user attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.SyncBatchNorm(8), nn.ReLU())
        self.head = nn.Conv2d(8, 4, 1)
        self.note = {"epochs": 3}
        self.seen: List[Tuple[int, ...]] = []
        self.head.register_forward_hook(lambda m, i, o: self.seen.append(tuple(o.shape)))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _model(train: bool = True) -> Net:
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():  # running statistics and a step count away from their defaults
        for bn in (m.features[1], m.features[4]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.num_batches_tracked.fill_(7)
    return m.train(train)


def _state(model: nn.Module) -> Dict[str, Any]:
    """What a user can observe of ``model`` without calling it."""
    out: Dict[str, Any] = {}
    for name, m in model.named_modules():
        attrs = {k: id(v) for k, v in vars(m).items()}
        out[name] = {
            "attrs": attrs,
            "children": [(n, id(c)) for n, c in m.named_children()],
            "params": [(n, id(p), p.data_ptr()) for n, p in m.named_parameters(recurse=False)],
            "buffers": [(n, id(b)) for n, b in m.named_buffers(recurse=False)],
            "hooks": [list(getattr(m, h).items()) for h in ("_forward_hooks", "_forward_pre_hooks",
                                                          "_backward_hooks", "_state_dict_hooks")],
            "class": type(m),
        }
    out["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _assert_same(before: Dict[str, Any], model: nn.Module) -> None:
    after = _state(model)
    assert before.keys() == after.keys(), f"modules changed: {sorted(set(before) ^ set(after))}"
    for name in before:
        if name == "state_dict":
            continue
        for what in ("attrs", "children", "params", "buffers", "hooks", "class"):
            assert before[name][what] == after[name][what], (
                f"{name or '<root>'}: {what} changed\nbefore {before[name][what]}\nafter  {after[name][what]}")
    sd0, sd1 = before["state_dict"], after["state_dict"]
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), f"{k} changed"
    for m in model.modules():
        assert "forward" not in vars(m) and "convbn_report" not in vars(m) and "fold_report" not in vars(m)


def _calls_like_eager(model: nn.Module, x: Tensor) -> None:
    twin = _model(model.training)
    model.load_state_dict(twin.state_dict())  # the same starting point
    out, ref = model(x), twin(x)
    torch.testing.assert_close(out, ref)
    assert "forward" not in vars(model)


BAD = torch.randn(2, 1, 8, 8)  # one channel into a three-channel conv
GOOD = torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("inplace", [True, False])
def test_convert_with_bad_example_inputs_changes_nothing(inplace: bool) -> None:
    model = _model()
    before = _state(model)
    with pytest.raises(RuntimeError, match="channels"):
        nn.Sequential(*copy.deepcopy(list(model.features)))(BAD)  # eager's own error
    with pytest.raises(RuntimeError, match="channels"):
        convbn.convert(model, inplace=inplace, example_inputs=BAD)
    _assert_same(before, model)
    _calls_like_eager(model, GOOD)


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_convert_failing_after_rewriting_changes_nothing(fault: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure late in the pipeline: the model was rewritten (installed forwards, chains,
    SyncBatchNorm swapped) by then."""
    model = _model()
    before = _state(model)
    rewritten: List[bool] = []

    def failing_plan(reference: nn.Module, work: nn.Module, *args: Any, **kwargs: Any) -> None:
        rewritten.append(any("forward" in vars(m) for m in work.modules()))
        raise fault("injected")

    monkeypatch.setattr(convert_api, "plan_auto", failing_plan)
    with pytest.raises(fault, match="injected"):
        convbn.convert(model, inplace=True, example_inputs=GOOD)
    assert rewritten == [True]  # the fault came after the rewrite
    _assert_same(before, model)
    _calls_like_eager(model, GOOD)


def test_fold_with_bad_example_inputs_changes_nothing() -> None:
    model = _model(train=False)
    before = _state(model)
    with pytest.raises(RuntimeError, match="channels"):
        convbn.fold(model, inplace=True, example_inputs=BAD)
    _assert_same(before, model)


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_fold_inplace_failing_after_folding_changes_nothing(fault: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """fold(inplace=True) writes the folded weights into the layers' own parameters: a failure
    after that puts the original weights back. An exception of the folded model in fold's check
    is the check's finding (the model is returned as it was, with a warning); Ctrl-C propagates."""
    model = _model(train=False)
    before = _state(model)
    calls: List[int] = []
    run = fold_api.run_no_grad

    def failing_run(m: nn.Module, args: Any) -> Any:
        calls.append(1)
        raise fault("injected")

    monkeypatch.setattr(fold_api, "run_no_grad", failing_run)
    if fault is KeyboardInterrupt:
        with pytest.raises(fault, match="injected"):
            convbn.fold(model, inplace=True, example_inputs=GOOD)
    else:
        with pytest.warns(RuntimeWarning, match="injected"):
            assert convbn.fold(model, inplace=True, example_inputs=GOOD) is model
        assert not model.convbn_report.folded
        detach_report(model)  # the report of what happened is the one addition
    assert calls  # the fault came after folding
    monkeypatch.setattr(fold_api, "run_no_grad", run)
    _assert_same(before, model)
    _calls_like_eager(model, GOOD)


def run_block(block: nn.Module, x: Tensor) -> Tensor:
    """A module handed to a function as a value (as ``checkpoint(self.block, x)`` does)."""
    return block(x)


torch.fx.wrap("run_block")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.drop = nn.Identity()  # unused by forward

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Passes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.block = Block()
        self.drop = nn.Identity()  # unused by forward

    def forward(self, x: Tensor) -> Tensor:
        return run_block(self.block, self.bn(self.conv(x)))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("example", [False, True])
def test_fold_keeps_the_children_of_modules_the_model_owns(inplace: bool, example: bool) -> None:
    torch.manual_seed(0)
    model = Passes().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8)
    ref = model(x)
    block_children = [(n, id(c)) for n, c in model.block.named_children()]
    keys = set(model.block.state_dict())
    folded = convbn.fold(model, inplace=inplace, example_inputs=x if example else None, check=example)
    assert folded.convbn_report.folded, folded.convbn_report
    assert [(n, id(c)) for n, c in model.block.named_children()] == block_children  # the user's block
    assert set(model.block.state_dict()) == keys
    assert [n for n, _ in folded.block.named_children()] == ["conv", "drop"]
    assert [n for n, _ in folded.named_children()] == ["conv", "bn", "block", "drop"]
    torch.testing.assert_close(folded(x), ref, rtol=1e-5, atol=1e-5)
    if not inplace:
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
