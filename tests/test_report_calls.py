"""Reports exact in both directions: what ``convbn_report`` lists as fused / folded equals the
BatchNorm calls that left the live model's forward (eager's count of eager-form batch norms
minus the converted / folded model's), read after the checks of the first calls ran, in the
mode converted, in the other mode, and with a hook added after conversion and removed again
(Note: [a report says what runs] in ``passes/report/live.py``)."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import convbn
from bn_calls import assert_report_matches_calls, counting_bn_calls, eager_bn_calls
from fusion_checks import assert_chain_ran
from robust_models import MODELS
from test_hook_built_models import HookUNet


def _train_steps(model: nn.Module, x: torch.Tensor, n: int = 2) -> None:
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        model(x).float().sum().backward()


CASES = {**MODELS, "hook_unet": (HookUNet, lambda: torch.randn(2, 3, 8, 8))}


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_convert_report_equals_the_calls_that_left(name: str, with_inputs: bool) -> None:
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model, x = make(), inputs()
    eager_train = eager_bn_calls(model, x)
    model.eval()
    eager_eval = eager_bn_calls(model, x)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = convbn.convert(model, example_inputs=x if with_inputs else None)
        _train_steps(fast, x)  # the first call's and first backward's checks done
    gone = assert_report_matches_calls(eager_train, fast, x, backward=True)
    assert gone > 0, fast.convbn_report
    # another mode: what runs then is what the report says then
    fast.eval()
    with torch.no_grad():
        assert_report_matches_calls(eager_eval, fast, x)
    fast.train()
    # a hook added later sends that BatchNorm's chain back to eager modules; removed, fused again
    bn = fast.get_submodule(next(o.batchnorm for o in fast.convbn_report.outcomes if o.result == "fused"))
    handle = bn.register_forward_hook(lambda *a: None)
    hooked = assert_report_matches_calls(eager_train, fast, x)
    handle.remove()
    assert hooked < gone
    assert assert_report_matches_calls(eager_train, fast, x) == gone


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.expect_unfused("fold: inference")
def test_fold_report_equals_the_calls_that_left(name: str, with_inputs: bool) -> None:
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model, x = make().eval(), inputs()
    with torch.no_grad():
        model(x)
        eager = eager_bn_calls(model, x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folded = convbn.fold(model, example_inputs=x if with_inputs else None)
            folded(x)  # the first call's check done
        gone = assert_report_matches_calls(eager, folded, x, result="folded")
    assert gone > 0, folded.convbn_report


class _ReturnDictNet(nn.Module):
    """A diffusers-style model: ``return_dict`` optional, and ``torch.is_tensor`` on an
    argument, so its symbolic trace fails and convert traces it with the example's real inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, sample: torch.Tensor, t: torch.Tensor, return_dict: bool = True) -> Any:
        if not torch.is_tensor(t):
            t = torch.tensor([t])
        out = self.body(sample) * t.float().view(-1, 1, 1, 1)
        return {"sample": out} if return_dict else (out,)


class _Wrapper(nn.Module):
    """The sweep's wrapper: extra inputs passed through ``*args``, ``return_dict=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _ReturnDictNet()

    def forward(self, sample: torch.Tensor, *args: Any) -> Any:
        return self.inner(sample, *args, return_dict=False)[0]


def test_report_after_convert_with_inputs_is_what_the_first_step_runs() -> None:
    """Traced with the example's real inputs, a module is traced for the call the example makes
    (``return_dict=False`` here, not the signature's ``True``): the report right after convert
    lists as fused what the first training step runs fused, with no variant needed
    (Note: [a trace with real inputs is specialised to their call])."""
    torch.manual_seed(0)
    model, inputs = _Wrapper(), (torch.randn(2, 3, 8, 8), torch.tensor([1.0, 2.0]))
    eager = eager_bn_calls(model, *inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = convbn.convert(model, example_inputs=inputs)
    report = fast.convbn_report
    assert report.traced == ["", "inner"] and report.validated == [""], report
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("inner.body.1", "fused"), ("inner.body.4", "fused")]
    assert not [str(w.message) for w in caught], "convert's own check ran a call off the traced values"
    # the first training step runs what the report said before it
    with counting_bn_calls() as calls:
        out = fast(*inputs)
        assert_chain_ran(out, calls=1)
        out.sum().backward()
    assert eager - len(calls) == 2, calls
    assert report.variants == [], report.variants
    assert assert_report_matches_calls(eager, fast, *inputs, backward=True) == 2


@pytest.mark.expect_unfused("fold: inference")
class _OwnCodeReturnDictNet(_ReturnDictNet):
    """:class:`_ReturnDictNet` whose own forward joins each convolution to its BatchNorm, so fold
    cannot fold it child by child (Note in ``passes/fold/generic.py``) and takes its trace with the
    call's real inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, sample: torch.Tensor, t: torch.Tensor, return_dict: bool = True) -> Any:
        if not torch.is_tensor(t):
            t = torch.tensor([t])
        out = self.body(torch.relu(self.bn(self.conv(sample)))[:, :3]) * t.float().view(-1, 1, 1, 1)
        return {"sample": out} if return_dict else (out,)


def test_fold_traces_a_module_for_the_call_its_example_makes() -> None:
    """fold's trace with the sample run's real inputs is for that call (``return_dict=False``):
    the folded graph runs on such calls, without the message about a call off the traced values."""
    torch.manual_seed(0)
    model, inputs = _Wrapper().eval(), (torch.randn(2, 3, 8, 8), torch.tensor([1.0, 2.0]))
    model.inner = _OwnCodeReturnDictNet().eval()
    with torch.no_grad():
        eager = eager_bn_calls(model, *inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            folded = convbn.fold(model, example_inputs=inputs)
            gone = assert_report_matches_calls(eager, folded, *inputs, result="folded")
    assert gone == 3, folded.convbn_report
    assert "folded part by part" not in str(folded.convbn_report), folded.convbn_report
    assert not [str(w.message) for w in caught if "traced as" in str(w.message)]


class _CalledTwice(nn.Module):
    """The same module called twice, the second time off the values its capture was traced for."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _ReturnDictNet()

    def forward(self, sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.inner(sample, t, return_dict=False)[0] + self.inner(sample, t)["sample"]


def test_report_after_convert_is_not_left_by_convert_s_own_check() -> None:
    """convert's check ran the second call before any variant was armed, so that call ran the
    module's own forward; the report must not say ``fallback`` for it after convert: the first
    step runs the capture fused and captures the variant for the second call."""
    torch.manual_seed(0)
    model, inputs = _CalledTwice(), (torch.randn(2, 3, 8, 8), torch.tensor([1.0, 2.0]))
    eager = eager_bn_calls(model, *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = convbn.convert(model, example_inputs=inputs)
    report = fast.convbn_report
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("inner.body.1", "fused"), ("inner.body.4", "fused")]
    out = fast(*inputs)
    assert_chain_ran(out, calls=2)  # the capture's chain, and the variant's for the second call
    out.sum().backward()
    assert len(report.variants) == 1, report.variants
    assert eager == 4 and eager_bn_calls(fast, *inputs, backward=True) == 0  # each BatchNorm called twice
    assert all(o.result == "fused" for o in report.outcomes), report
