"""The (peak, time) frontier (issue 42): the non-dominated set, the table, and
``convbn explain --frontier`` (table path). Nothing here asserts a time: the measured points'
times are the clock's, only the frontier drawn from them is checked."""
import math
import random
import re

import pytest
import torch

from convbn.bench.frontier import FrontierPoint, dominates, frontier_table, mark_frontier, pareto_front
from convbn.bench.frontier_run import FrontierSettings, frontier_configs
from convbn.bench.models import MNISTNet


def _brute_front(points):
    ok = [i for i, (p, t) in enumerate(points) if not (math.isnan(p) or math.isnan(t))]
    return {i for i in ok if not any(dominates(points[j], points[i]) for j in ok if j != i)}


@pytest.mark.parametrize("seed", range(20))
def test_pareto_front_is_the_non_dominated_set(seed):
    rnd = random.Random(seed)
    # small integer grids: many ties on one axis or both
    points = [(float(rnd.randint(0, 6)), float(rnd.randint(0, 6))) for _ in range(rnd.randint(1, 12))]
    if seed % 4 == 0:
        points.append((float("nan"), 1.0))
    front = pareto_front(points)
    assert set(front) == _brute_front(points)
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)  # by rising peak


def test_pareto_front_cases():
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]
    assert pareto_front([(2.0, 1.0), (1.0, 2.0), (2.0, 2.0)]) == [1, 0]  # (2, 2) dominated by both
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points: neither dominates
    assert pareto_front([(1.0, 2.0), (1.0, 1.0)]) == [1]  # same peak, slower: dominated
    assert pareto_front([(1.0, 2.0), (2.0, 2.0)]) == [0]  # same time, higher peak: dominated
    assert pareto_front([(1.0, float("nan")), (2.0, 2.0)]) == [1]  # a failed configuration is never on it
    assert dominates((1, 1), (1, 2)) and not dominates((1, 1), (1, 1)) and not dominates((0, 2), (1, 1))


def test_mark_frontier_and_the_table():
    pts = [FrontierPoint("eager", 100 * 2**20, 0.0105), FrontierPoint("torch.compile", 120 * 2**20, 0.008),
           FrontierPoint("checkpoint per block", 110 * 2**20, 0.013),
           FrontierPoint("convert time=1.05", 60 * 2**20, 0.0104, chosen=True)]
    marked = mark_frontier(pts)
    assert [p.on_frontier for p in marked] == [False, True, False, True]
    table = frontier_table(marked)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert "| 0.600 |" in rows["convert time=1.05"] and "<- time_budget" in rows["convert time=1.05"]
    assert "*" in rows["torch.compile"] and "*" not in rows["eager"]
    plain = frontier_table(marked, markdown=False)
    assert "|" not in plain and "1.200" in plain


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fp8"), "precision must be one of"),
    (dict(rounds=0), "rounds must be an integer >= 1"),
    (dict(plans=-1), "plans must be an integer >= 0"),
    (dict(compile_budgets=(1.5,)), r"compile budgets must be fractions in \(0, 1\]"),
])
def test_bad_settings_raise_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrontierSettings(**kwargs)


def test_the_configurations_span_compile_checkpointing_and_convbn_plans():
    torch.manual_seed(0)
    model, x = MNISTNet(), torch.randn(4, 1, 28, 28)
    names = list(frontier_configs(model, x, FrontierSettings(plans=2, time_budgets=(1.05,))))
    assert names[:5] == ["eager", "torch.compile", "torch.compile budget=0.5", "torch.compile budget=0.3",
                         "checkpoint per block"]
    plans = [n for n in names if n.startswith("convert")]
    assert plans[:2] == ["convert auto", "convert auto + compile"]
    assert len([n for n in plans if n.startswith("convert peak=")]) == 4  # two plans, each also compiled
    assert plans[-2:] == ["convert time=1.05", "convert time=1.05 + compile"]
    peaks = [float(n.split("=")[1].split()[0]) for n in plans if n.startswith("convert peak=") and "+" not in n]
    assert peaks[-1] == 1.0 and 0 < peaks[0] < 1.0  # from the lowest reachable to eager's


def test_explain_frontier_prints_the_table(capsys):
    from convbn.cli import main

    assert main(["explain", "mnist", "--input-shape", "4x1x28x28", "--frontier", "--no-compile", "--rounds", "1",
                 "--plans", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["config", "peak", "MiB"]
    names = [l.split("  ")[0] for l in lines[2:]]
    assert names[:3] == ["eager", "checkpoint per block", "convert auto"] and names[3].startswith("convert peak=")
    # the frontier marks follow the printed numbers (peak MiB, step ms)
    cells = [re.split(r"\s{2,}", l) for l in lines[2:]]
    pts = [(float(c[1]), float(c[3])) for c in cells]
    starred = {i for i, l in enumerate(lines[2:]) if "*" in l}
    assert starred
    for i, (p, t) in enumerate(pts):  # as far as one printed decimal tells
        better = [j for j, (q, u) in enumerate(pts) if j != i and q <= p - 0.1 and u <= t - 0.1]
        within = [j for j, (q, u) in enumerate(pts) if j != i and q <= p + 0.05 and u <= t + 0.05]
        assert (not better) if i in starred else bool(within), (i, pts, starred)


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "needs a CUDA input"),
    (["--strategy", "recompute_bn"], "--frontier measures convbn's auto plans"),
    (["--peak-budget", "0.5"], "leave out --memory, --memory-budget and --peak-budget"),
])
def test_explain_frontier_errors_are_one_line_exit_2(capsys, argv, message):
    from convbn.cli import main

    assert main(["explain", "mnist", "--input-shape", "4x1x28x28", "--frontier", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _conv_bn_net() -> torch.nn.Sequential:
    """Three Conv3x3 -> BN -> ReLU blocks and a head: every conv weight has a channels_last
    copy distinct from itself (a 1x1 weight's would have the same strides)."""
    nn = torch.nn

    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

    torch.manual_seed(0)
    return nn.Sequential(*block(3, 8), *block(8, 16), *block(16, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 4)).train()


def test_compiled_converted_model_saves_no_copy_of_a_conv_weight():
    """Note: [a conv inductor cannot re-layout]. Under a plain ``torch.compile`` (inductor, its
    layout optimisation on as by default) the converted model's backward keeps each conv weight
    as the parameter itself: exactly the activations the uncompiled converted model keeps, and no
    saved storage shaped like a conv weight that is not the parameter (inductor's channels_last
    weight copies, 3 x 3 x 3 x 8 + 8 x 3 x 3 x 16 + 16 x 3 x 3 x 16 floats, are what a visible
    ``aten.convolution`` makes it save)."""
    import copy
    import warnings

    import convbn
    from convbn.autograd.chain_compiled import compile_chains_mode
    from convbn.memory import saved_bytes
    from fusion_checks import assert_fused

    assert compile_chains_mode() == "inductor"
    x = torch.randn(4, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = convbn.convert(_conv_bn_net(), strategy="recompute_bn")
    assert_fused(fast, chains=1)
    eager_saved = saved_bytes(copy.deepcopy(fast), x)
    torch._dynamo.reset()
    compiled = torch.compile(fast)
    compiled(x).sum().backward()  # compiles (inductor)
    fast.zero_grad(set_to_none=True)
    saved = saved_bytes(compiled, x)
    weights = {tuple(m.weight.shape) for m in fast.modules() if isinstance(m, torch.nn.Conv2d)}
    copies = [(s, n) for (_, s, _, n), p in zip(saved.shapes, saved.is_param) if not p and s in weights]
    assert copies == [], copies
    assert saved.activation_bytes == eager_saved.activation_bytes, (saved.activation_bytes,
                                                                    eager_saved.activation_bytes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("convbn::")}
    assert ops.get("convbn::conv", 0) == 3 and "convbn::chain_fwd" not in ops, ops  # the inductor chain ran


@pytest.mark.parametrize("scaled", [False, True])
def test_backward_and_step_with_and_without_a_grad_scaler(scaled):
    """The benchmarks' one step after the loss (bench/common.py): with a GradScaler the
    parameters move exactly as without one (the scale is a power of two, unscaled before the
    step), and the scaler's ``update`` ran."""
    from convbn.bench.common import backward_and_step

    torch.manual_seed(0)
    ref, net = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    net.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3)
    ref(x).square().mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1) if scaled else None
    backward_and_step(net(x).square().mean(), torch.optim.SGD(net.parameters(), lr=0.1), scaler)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    if scaled:
        assert scaler.get_scale() == 2.0**5  # update() grew it after one finite step
