"""``convert(peak_budget=...)``: the step's peak as a budget (issue 12), beside ``memory_budget``
(saved bytes). Peaks on CPU are exact live-tensor bytes, so they are asserted to the byte."""
import copy
import itertools
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import convbn
from convbn.passes.plan.peak_model import ChainCost, step_peak
from convbn.passes.plan.peak_planner import plan_within_peak

from fusion_checks import assert_chain_ran, assert_fused, fused_chains
from test_peak_memory import _residual_net


def _recompute(report):
    return sum(p.extra_flops for p in report.pairs)


@pytest.fixture(scope="module")
def net_and_input():
    torch.manual_seed(0)
    return _residual_net(16), torch.randn(8, 3, 32, 32)


@pytest.mark.parametrize("budget", [0.7, 0.8, 0.9])
def test_predicted_and_measured_peak_fit_the_budget(net_and_input, budget):
    net, x = net_and_input
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reachable: no warning
        report = convbn.explain(net, x, peak_budget=budget)
    assert report.target_peak_bytes == int(budget * report.eager_peak_bytes)
    assert report.predicted_peak_bytes <= report.target_peak_bytes
    assert report.measured_peak_bytes <= report.target_peak_bytes
    assert report.measured_peak_bytes == report.predicted_peak_bytes
    assert report.target_saved_bytes is None  # a peak budget alone limits no saved bytes
    assert "peak budget" in str(report) and "met" in str(report)


def test_a_larger_peak_budget_never_recomputes_more(net_and_input):
    net, x = net_and_input
    costs = [_recompute(convbn.explain(net, x, peak_budget=b)) for b in (0.7, 0.75, 0.8, 0.9)]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]


def test_an_unreachable_peak_budget_plans_the_lowest_peak_and_says_so(net_and_input):
    net, x = net_and_input
    with pytest.warns(UserWarning, match=r"peak_budget=0.3 asks for .* below the lowest any plan reaches"):
        report = convbn.explain(net, x, peak_budget=0.3)
    assert report.predicted_peak_bytes > report.target_peak_bytes
    assert report.predicted_peak_bytes == report.lowest_peak_bytes == report.measured_peak_bytes
    assert "unreachable" in str(report)


def test_memory_and_peak_budgets_together_are_both_limits(net_and_input):
    net, x = net_and_input
    both = convbn.explain(net, x, peak_budget=0.8, memory_budget=0.5)
    assert both.saved_bytes <= both.target_saved_bytes
    assert both.predicted_peak_bytes <= both.target_peak_bytes
    assert both.measured_peak_bytes == both.predicted_peak_bytes
    # the saved-bytes limit binds: more recompute than the peak budget alone asks
    assert _recompute(both) > _recompute(convbn.explain(net, x, peak_budget=0.8))
    with pytest.warns(UserWarning, match="within memory_budget"):
        convbn.explain(net, x, peak_budget=0.3, memory_budget=0.5)


def _still_converts_and_trains_fused(net, x) -> None:
    """A rejected call changed nothing: the model converts and trains through its chains."""
    fast = convbn.convert(copy.deepcopy(net), strategy="recompute_conv")
    assert_fused(fast, strategies={"recompute_conv"})
    assert_chain_ran(fast(x[:2].clone().requires_grad_()), calls=len(fused_chains(fast)))


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, True, "0.5", float("nan")])
def test_bad_peak_budgets_raise_naming_the_value(net_and_input, bad):
    net, x = net_and_input
    with pytest.raises(ValueError, match=f"peak_budget must be .* but got {bad!r}"):
        convbn.convert(net, peak_budget=bad, example_inputs=x)
    _still_converts_and_trains_fused(net, x)


def test_peak_budget_needs_auto_and_example_inputs(net_and_input):
    net, x = net_and_input
    with pytest.raises(ValueError, match="needs example_inputs"):
        convbn.convert(net, peak_budget=0.5)
    with pytest.raises(ValueError, match="strategy='auto' only"):
        convbn.convert(net, strategy="recompute_conv", peak_budget=0.5, example_inputs=x)
    _still_converts_and_trains_fused(net, x)


def test_plan_within_peak_is_the_least_recompute_under_the_peak():
    """Against brute force over every plan of small random chains, with and without moments
    outside the chains (``gaps``)."""
    rng = random.Random(0)
    for _ in range(30):
        costs = []
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(1, 3)
            ys = tuple(rng.randint(1, 9) for _ in range(k))
            costs.append(ChainCost(ys, (rng.randint(1, 9),) + ys[:-1], tuple(rng.randint(1, 50) for _ in range(k)),
                                   tuple(rng.choice(("output", "smooth", "identity")) for _ in range(k)),
                                   prefix=rng.randint(0, 20)))
        floor, extra = rng.randint(0, 10), rng.randint(0, 30)
        gaps = [rng.randint(0, 40) for _ in range(len(costs) + 1)] if rng.random() < 0.5 else None
        flat = [len(c.y_bytes) for c in costs]
        plans = []
        for bits in itertools.product([False, True], repeat=sum(flat)):
            keeps, i = [], 0
            for n in flat:
                keeps.append(list(bits[i:i + n]))
                i += n
            if sum(c.kept_bytes(kp) for c, kp in zip(costs, keeps)) <= extra:
                recompute = sum(m for c, kp in zip(costs, keeps) for m, f in zip(c.macs, kp) if not f)
                plans.append((step_peak(costs, keeps, floor, gaps=gaps)[0], recompute))
        lowest = min(p for p, _ in plans)
        for peak in (lowest - 1, lowest, lowest + 3, lowest + 10):
            keeps, low, reached = plan_within_peak(costs, floor, extra, peak, gaps)
            assert low == lowest and reached == (peak >= lowest)
            got = step_peak(costs, keeps, floor, gaps=gaps)[0]
            assert got <= max(peak, lowest)
            recompute = sum(m for c, kp in zip(costs, keeps) for m, f in zip(c.macs, kp) if not f)
            assert recompute == min(r for p, r in plans if p <= max(peak, lowest))


def test_bench_names_a_configuration_per_peak_budget():
    from convbn.bench.training_configs import config_names
    assert config_names(["auto"], budgets=[0.4], peak_budgets=[0.5]) == [
        "eager", "convert auto", "convert auto budget=0.4", "convert auto peak=0.5"]
    with pytest.raises(ValueError, match="positive fractions"):
        config_names(["budget"], peak_budgets=[0.0])


def test_explain_cli_takes_a_peak_budget(capsys):
    from convbn.cli import main
    assert main(["explain", "mnist", "--input-shape", "8x1x28x28", "--peak-budget", "0.95"]) == 0
    assert "peak budget:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "mnist", "--peak-budget", "1.5"])
    assert main(["explain", "mnist", "--strategy", "recompute_bn", "--peak-budget", "0.5"]) == 2
    assert "--peak-budget is used by --strategy auto only" in capsys.readouterr().err


@pytest.mark.parametrize("budget", [0.8, 0.9, 1.0])
def test_a_peak_outside_the_chains_is_predicted(budget):
    """Note: [moments outside the chains]: on the tutorial's MNIST network with a max-pool that
    keeps its input (asked for its indices, so convert leaves it as eager runs it: no lean
    pooling), a plan keeping every conv output peaks in the max-pool's backward, not in the
    chain's."""
    from convbn.bench.models import MNISTNet

    class IndicesPoolNet(MNISTNet):
        def forward(self, x):
            x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
            x = torch.flatten(self.dropout1(F.max_pool2d(x, 2, return_indices=True)[0]), 1)
            return F.log_softmax(self.fc2(self.dropout2(F.relu(self.fc1(x)))), dim=1)

    torch.manual_seed(0)
    model = IndicesPoolNet()
    report = convbn.explain(model, torch.randn(64, 1, 28, 28), peak_budget=budget)
    assert report.measured_peak_bytes == report.predicted_peak_bytes <= report.target_peak_bytes
    if budget == 1.0:
        assert _recompute(report) == 0
        assert report.predicted_peak_where == "outside the chains"
        assert "MaxPool2DWithIndicesBackward" in report.measured_peak_where
