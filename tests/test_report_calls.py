"""Reports exact in both directions: what ``convbn_report`` lists as fused / folded equals the
BatchNorm calls that left the live model's forward (eager's count of eager-form batch norms
minus the converted / folded model's), read after the checks of the first calls ran, in the
mode converted, in the other mode, and with a hook added after conversion and removed again
(Note: [a report says what runs] in ``passes/report/live.py``)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import convbn
from bn_calls import assert_report_matches_calls, eager_bn_calls
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
