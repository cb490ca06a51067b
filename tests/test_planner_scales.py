"""The peak planner's dynamic programme, vectorised (``least_recompute``), against its plain
Python reference (``least_recompute_reference``): the same plan on random models, fronts thinned
or not, and a model of hundreds of chains planned (Note: [a planner that scales])."""
from __future__ import annotations

import random

import pytest

from convbn.passes.plan.peak_model import ChainCost
from convbn.passes.plan.peak_planner import (chain_options, least_recompute, least_recompute_reference, lowest_peak,
                                             plan_for_peak)


def _costs(rnd: random.Random, chains: int, floats: bool = False, ties: bool = False) -> list:
    costs = []
    for _ in range(chains):
        k = rnd.randint(1, 5)
        ys = tuple(rnd.randint(1, 400) for _ in range(k))
        xs = (rnd.randint(1, 400),) + ys[:-1]
        macs = tuple((rnd.random() * 1000 if floats else rnd.choice((10, 20)) if ties else rnd.randint(1, 1000))
                     for _ in range(k))
        acts = tuple(rnd.choice(["identity", "output", "smooth"]) for _ in range(k))
        costs.append(ChainCost(ys, xs, macs, acts, prefix=rnd.randint(0, 2000)))
    return costs


@pytest.mark.parametrize("max_front", [4096, 7, 2])
@pytest.mark.parametrize("seed", range(20))
def test_vectorised_programme_gives_the_reference_plan(seed: int, max_front: int) -> None:
    rnd = random.Random(seed)
    costs = _costs(rnd, rnd.randint(1, 12), floats=seed % 4 == 1, ties=seed % 4 == 2)  # ties: many equal costs
    floor = rnd.randint(0, 3000)
    budget = rnd.randint(0, sum(sum(c.y_bytes) for c in costs))
    gaps = [rnd.randint(0, 3000) for _ in range(len(costs) + 1)] if seed % 3 == 0 else None
    options = [chain_options(c) for c in costs]
    low = lowest_peak(costs, options, floor, budget, gaps)
    for peak in (low - 1, low, int(low * 1.05), int(low * 1.3), 10 ** 9):
        want = least_recompute_reference(costs, options, floor, budget, peak, max_front=max_front, gaps=gaps)
        got = least_recompute(costs, options, floor, budget, peak, max_front=max_front, gaps=gaps)
        assert got == want, (seed, peak)


def test_a_model_of_hundreds_of_chains_plans_like_the_reference() -> None:
    """An HRNet-sized plan (300 chains) thins its front: the plan equals the reference's."""
    rnd = random.Random(1)
    costs = _costs(rnd, 300)
    options = [chain_options(c) for c in costs]
    budget = sum(sum(c.y_bytes) for c in costs)
    low = lowest_peak(costs, options, 0, budget)
    peak = int(low * 1.08)
    assert least_recompute(costs, options, 0, budget, peak) == least_recompute_reference(costs, options, 0, budget, peak)
    assert plan_for_peak(costs, 0, budget)  # the default plan, end to end
