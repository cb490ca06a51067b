"""``Linear`` on ``(N, L, C)`` -> ``transpose(-1, 1)`` -> ``BatchNorm1d`` -> ``transpose(-1, 1)``
(speechbrain's CRDNN writes the swap with a negative dim): converted, the Linear and the
BatchNorm1d fuse and train like eager; folded, the BatchNorm goes into the Linear; on
2-D rows the same code (the transposes do nothing there) still equals eager."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused

SWAPS = {
    "transpose(-1, 1)": lambda y: y.transpose(-1, 1),
    "transpose(2, 1)": lambda y: y.transpose(2, 1),
    "torch.transpose(y, 1, -1)": lambda y: torch.transpose(y, 1, -1),
    "permute(0, 2, 1)": lambda y: y.permute(0, 2, 1),
}


class TokenBN(nn.Module):
    def __init__(self, swap: str) -> None:
        super().__init__()
        self.swap = SWAPS[swap]
        self.fc, self.bn = nn.Linear(6, 5), nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        y = self.swap(self.bn(self.swap(self.fc(x))))
        return self.out(torch.relu(y))


def _tokens(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (4, 7, 6)), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("with_inputs", [True, False], ids=["example_inputs", "no_example_inputs"])
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_token_batchnorm_behind_any_spelling_of_the_swap_fuses_and_trains_like_eager(swap, with_inputs):
    eager, fast = twins(lambda: TokenBN(swap))
    fast = convbn.convert(fast, example_inputs=_tokens(9) if with_inputs else None)
    assert_fused(fast, pairs=1)
    for k in range(3):
        x = _tokens(k)
        torch.testing.assert_close(step(fast, x, seed=k), step(eager, x, seed=k), **TOL)
        assert_same_state(eager, fast)
    torch.manual_seed(0)
    assert_chain_ran(fast(_tokens(5)), calls=1)


def test_negative_dim_swap_on_rows_still_equals_eager_and_other_ranks_raise_as_eager():
    eager, fast = twins(lambda: TokenBN("transpose(-1, 1)"))
    fast = convbn.convert(fast, example_inputs=_tokens(9))
    rows = _tokens(3, 8, 6)  # transpose(-1, 1) of (8, 5) is itself: BatchNorm1d over rows
    torch.testing.assert_close(step(fast, rows), step(eager, rows), **TOL)
    assert_same_state(eager, fast)
    with pytest.raises(ValueError, match="4D"):
        eager(_tokens(3, 2, 3, 4, 6))
    with pytest.raises(ValueError, match="4D"):
        fast(_tokens(3, 2, 3, 4, 6))


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_fold_token_batchnorm_behind_any_spelling_of_the_swap(swap):
    torch.manual_seed(0)
    model = TokenBN(swap).double()
    for k in range(2):
        model(_tokens(k))  # running statistics away from their initial values
    model.eval()
    x = _tokens(7)
    folded = convbn.fold(copy.deepcopy(model), example_inputs=x)
    assert {o.batchnorm: o.layer for o in folded.convbn_report.folded} == {"bn": "fc"}
    assert not any(isinstance(m, nn.BatchNorm1d) for m in folded.modules())
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), **TOL)
