"""``convert(time_budget=...)`` (issue 42): the lowest predicted peak within a step-time ratio
of the unconverted model's. Every choice here is made on injected step costs (the measurement
is replaced), so no outcome depends on the clock; peaks on CPU are exact live-tensor bytes."""
import copy
import itertools
import random
import warnings

import pytest
import torch

import convbn
from convbn.passes.plan import step_costs as step_costs_module
from convbn.passes.plan.peak_model import ChainCost, drops_needed, step_peak
from convbn.passes.plan.time_planner import TIME_MARGIN, StepCosts, plan_within_time

from capture_helpers import assert_steps_match
from fusion_checks import assert_fused, fused_chains
from test_peak_memory import _residual_net


def _layer_flops(layer):
    return max(1, layer.recompute_cost()) if layer.conv is not None else 0


def _inject(monkeypatch, eager=1.0, base=1.0, per_mac=1e-9, record=None):
    """Replace the measurement: each conv's cost proportional to its recompute cost (MAC
    equivalents) at ``per_mac`` seconds each; eager's and the keep-all step's as given."""
    def fake(original, converted, chains, inputs, **kwargs):
        conv = tuple(tuple(_layer_flops(l) * per_mac for l in c.layers) for c in chains)
        costs = StepCosts(eager, base, conv, tuple(tuple(l.names[0] for l in c.layers) for c in chains))
        if record is not None:
            record.append(costs)
        return costs

    monkeypatch.setattr(step_costs_module, "measure_step_costs", fake)


@pytest.fixture(scope="module")
def net_and_input():
    torch.manual_seed(0)
    return _residual_net(16), torch.randn(8, 3, 32, 32)


def _keeps(model):
    return [[l.mode == "recompute_bn" for l in c.layers] for c in fused_chains(model)]


def _lowest_peak(net, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convbn.explain(net, x, peak_budget=0.01).lowest_peak_bytes


def test_a_loose_time_budget_gets_the_lowest_peak(monkeypatch, net_and_input):
    net, x = net_and_input
    _inject(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reachable: no warning
        report = convbn.explain(net, x, time_budget=100.0)
    assert report.predicted_peak_bytes == _lowest_peak(net, x) == report.measured_peak_bytes
    assert "time budget: 100.0x" in str(report) and "step costs measured" in str(report)


def test_a_tight_time_budget_recomputes_no_conv(monkeypatch, net_and_input):
    """Every conv costs more than the budget leaves: each layer keeps its conv output (the
    default plan recomputes some, so a planner ignoring the budget fails here)."""
    net, x = net_and_input
    _inject(monkeypatch, eager=1.0, base=0.9, per_mac=1.0)
    default = convbn.convert(copy.deepcopy(net), example_inputs=x)
    assert any(l.mode == "recompute_conv" for c in fused_chains(default) for l in c.layers)
    model = convbn.convert(copy.deepcopy(net), example_inputs=x, time_budget=1.05)
    report = assert_fused(model)
    assert all(all(k for k in kp) for kp in _keeps(model))
    assert report.predicted_time_ratio == pytest.approx(0.9)
    assert_steps_match(copy.deepcopy(net), model, x)


@pytest.mark.parametrize("ratio", [1.02, 1.1, 1.3])
def test_the_chosen_plan_is_within_the_budget_and_the_lowest_peak_there(monkeypatch, net_and_input, ratio):
    """Against every plan the planner could pick: brute force over the chains' keep flags,
    with the same injected costs and the planner inputs this convert call measured."""
    from convbn.passes.plan import auto_plan

    net, x = net_and_input
    record, seen = [], []
    # total recompute of every conv = 0.25 of eager's step: the budgets cut across the plans
    _inject(monkeypatch, eager=1.0, base=1.0, per_mac=0.25 / _total_cost(net, x), record=record)
    real = auto_plan.plan_within_time
    monkeypatch.setattr(auto_plan, "plan_within_time", lambda *a: seen.append(a) or real(*a))
    model = convbn.convert(copy.deepcopy(net), example_inputs=x, time_budget=ratio)
    report, costs = model.convbn_report, record[-1]
    chain_costs, floor, _, _, _, gaps = seen[-1]
    keeps = [[l.mode == "recompute_bn" for l in c.layers] for c in _forward_order(model, costs)]
    assert costs.predict(keeps) == pytest.approx(report.predicted_time_ratio * costs.eager)
    assert costs.predict(keeps) <= (ratio - TIME_MARGIN) * costs.eager
    fitting = [p for p, t in _all_plans(chain_costs, floor, gaps, costs) if t <= (ratio - TIME_MARGIN) * costs.eager]
    assert report.predicted_peak_bytes == min(fitting)
    if ratio == 1.3:  # everything fits: the lowest peak of all
        assert report.predicted_peak_bytes == min(p for p, _ in _all_plans(chain_costs, floor, gaps, costs))
    assert_steps_match(copy.deepcopy(net), model, x)


def _forward_order(model, costs):
    by_name = {tuple(l.names[0] for l in c.layers): c for c in fused_chains(model)}
    return [by_name[names] for names in costs.names]


def _total_cost(net, x):
    model = convbn.convert(copy.deepcopy(net), example_inputs=x)
    return sum(_layer_flops(l) for c in fused_chains(model) for l in c.layers)


def _all_plans(chain_costs, floor, gaps, costs):
    """(predicted peak, predicted seconds) of every plan, the peak as convert predicts the plan it applies."""
    flat = [len(c.y_bytes) for c in chain_costs]
    out = []
    for bits in itertools.product([True, False], repeat=sum(flat)):
        it = iter(bits)
        keeps = [[next(it) for _ in range(n)] for n in flat]
        drops = drops_needed(chain_costs, keeps, floor, gaps)
        out.append((step_peak(chain_costs, keeps, floor, may_drop=drops, gaps=gaps)[0], costs.predict(keeps)))
    return out


def test_an_unreachable_time_budget_plans_the_fastest_and_says_so(monkeypatch, net_and_input):
    net, x = net_and_input
    _inject(monkeypatch, eager=1.0, base=1.2)
    with pytest.warns(UserWarning, match=r"time_budget=1.05 asks for .* planned for the fastest"):
        model = convbn.convert(copy.deepcopy(net), example_inputs=x, time_budget=1.05)
    assert all(all(k for k in kp) for kp in _keeps(model))
    assert "no plan fits" in str(model.convbn_report)


@pytest.mark.parametrize("seed", range(12))
def test_plan_within_time_is_the_lowest_peak_in_time(seed):
    """Random chains against brute force: the chosen plan fits the time and no fitting plan
    peaks lower; where none fits, the fastest."""
    rnd = random.Random(seed)
    costs = []
    for _ in range(rnd.randint(1, 3)):
        k = rnd.randint(1, 3)
        costs.append(ChainCost(tuple(rnd.randint(1, 16) for _ in range(k)), tuple(rnd.randint(1, 16) for _ in range(k)),
                               (0,) * k, tuple(rnd.choice(["output", "smooth", "identity"]) for _ in range(k)),
                               prefix=rnd.randint(0, 40)))
    step = StepCosts(1.0, rnd.uniform(0.9, 1.05), tuple(tuple(rnd.uniform(0.0, 0.1) for _ in c.y_bytes) for c in costs))
    budget = rnd.uniform(1.0, 1.3)
    floor = rnd.randint(0, 30)
    flat = [len(c.y_bytes) for c in costs]
    plans = []
    for bits in itertools.product([True, False], repeat=sum(flat)):
        it = iter(bits)
        keeps = [[next(it) for _ in range(n)] for n in flat]
        plans.append((step_peak(costs, keeps, floor)[0], step.predict(keeps)))
    chosen = plan_within_time(costs, floor, 1 << 40, step, budget)
    limit = (budget - TIME_MARGIN) * step.eager
    fitting = [p for p, t in plans if t <= limit + 1e-9]
    assert chosen.peak == step_peak(costs, chosen.keeps, floor)[0]
    if fitting:
        assert chosen.reached and chosen.seconds <= limit + 1e-9
        assert chosen.peak == min(fitting)
    else:
        assert not chosen.reached
        assert chosen.seconds == pytest.approx(min(t for _, t in plans), abs=1e-6)


@pytest.mark.parametrize("bad", [0, -1.0, True, "1.05", float("inf"), float("nan")])
def test_bad_time_budgets_raise_naming_the_value(net_and_input, bad):
    net, x = net_and_input
    with pytest.raises(ValueError, match=r"time_budget must be a positive ratio .* but got"):
        convbn.convert(net, example_inputs=x, time_budget=bad)


def test_time_budget_needs_auto_example_inputs_and_no_peak_asked(net_and_input):
    net, x = net_and_input
    with pytest.raises(ValueError, match="strategy='auto' only"):
        convbn.convert(net, example_inputs=x, strategy="recompute_bn", time_budget=1.1)
    with pytest.raises(ValueError, match="needs example_inputs"):
        convbn.convert(net, time_budget=1.1)
    with pytest.raises(ValueError, match="not both"):
        convbn.convert(net, example_inputs=x, time_budget=1.1, peak_budget=0.8)
    with pytest.raises(ValueError, match="not both"):
        convbn.convert(net, example_inputs=x, time_budget=1.1, memory_limit="1GiB")


def test_step_costs_are_measured_with_state_and_plans_restored(net_and_input):
    """The real measurement (its values are the clock's, so only their shape is asserted):
    one cost per layer, positive where a conv runs, and the model left as it was."""
    net, x = net_and_input
    model = convbn.convert(copy.deepcopy(net), example_inputs=x)
    chains = fused_chains(model)
    plans = [c.plan for c in chains]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = step_costs_module.measure_step_costs(copy.deepcopy(net), model, chains, (x,), rounds=1, repeats=1)
    assert [len(c) for c in costs.conv] == [len(c.layers) for c in chains]
    assert all((t > 0) == (l.conv is not None) for c, ts in zip(chains, costs.conv) for l, t in zip(c.layers, ts))
    assert costs.eager > 0 and costs.base > 0
    assert [c.plan for c in chains] == plans
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
