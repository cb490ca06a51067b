"""``fold(inplace=False)`` folds a copy: one that works where ``copy.deepcopy`` refuses the model
(Note: [a copy that runs like the model] in ``passes/graph/model_copy.py``), or a clear error
naming ``inplace=True``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import randomise_batchnorms

pytestmark = pytest.mark.expect_unfused("fold: inference")


class KeepsNonLeaf(nn.Module):
    """In eval mode (grad on) keeps non-leaf tensors: as an attribute and in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
        self.emb = nn.Parameter(torch.randn(6))
        self.cache: list = [None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.pos = self.emb * 2
            self.cache[0] = self.emb + 1
        return torch.relu(self.bn(self.lin(x))) + self.emb


def _eval_model() -> KeepsNonLeaf:
    torch.manual_seed(0)
    model = randomise_batchnorms(KeepsNonLeaf()).eval()
    model(torch.randn(3, 6, dtype=torch.float64))  # the non-leaf tensors now exist
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(model)
    return model


@pytest.mark.parametrize("with_inputs", [False, True])
def test_fold_copies_a_model_deepcopy_refuses(with_inputs: bool) -> None:
    model = _eval_model()
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = model(x).detach()
    weight = model.lin.weight.detach().clone()
    folded = convbn.fold(model, example_inputs=x if with_inputs else None)
    assert folded is not model and folded.lin is not model.lin
    assert [o.batchnorm for o in folded.convbn_report.folded] == ["bn"]
    torch.testing.assert_close(folded(x), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(model.lin.weight, weight, rtol=0, atol=0)  # the user's model untouched
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


class Uncopyable(KeepsNonLeaf):
    def __deepcopy__(self, memo: dict) -> "Uncopyable":
        raise RuntimeError("this model holds a handle that cannot be copied")


def test_fold_of_an_uncopyable_model_names_inplace() -> None:
    torch.manual_seed(0)
    model = Uncopyable().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"inplace=True") as info:
        convbn.fold(model)
    assert "Uncopyable" in str(info.value) and "cannot be copied" in str(info.value)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    folded = convbn.fold(model, inplace=True)
    assert folded is model and [o.batchnorm for o in folded.convbn_report.folded] == ["bn"]


class ReadsItsBatchNorm(nn.Module):
    """Reads its BatchNorm's weight outside the BatchNorm: the whole-model fold replaces the
    BatchNorm's slot, so the folded forward fails where it reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) * self.bn.weight.view(1, -1, 1, 1)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("with_inputs", [False, True])
def test_a_failing_fold_check_leaves_the_model_and_says_why(inplace: bool, with_inputs: bool) -> None:
    torch.manual_seed(0)
    model = randomise_batchnorms(ReadsItsBatchNorm()).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = model(x).detach()
    with pytest.warns(RuntimeWarning, match="returned unfolded"):
        folded = convbn.fold(model, example_inputs=x if with_inputs else None, inplace=inplace)
    assert (folded is model) == inplace
    report = folded.convbn_report
    assert not report.folded and [o.batchnorm for o in report.skipped] == ["bn"], report
    assert "fold's check" in report.skipped[0].reason and "left unfolded" in report.skipped[0].reason
    assert report.check is not None and not report.check.passed
    torch.testing.assert_close(folded(x), expected, rtol=0, atol=0)
    assert isinstance(model.bn, nn.BatchNorm2d) and model.forward.__func__ is ReadsItsBatchNorm.forward
