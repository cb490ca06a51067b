"""Step time of one converted network under several plans, side by side in one process.

:mod:`bm_norm_nets` converts the network once per configuration; this benchmark converts it
once and swaps only the chains' plans (``FusedChain.apply_plan``) between steps, so that what
differs between the rows is what each chain keeps and recomputes, nothing else (the same
module objects, the same allocator history). Plans:

* ``default``: what :func:`convbn.convert` chose (``example_inputs``, the default plan);
* ``lowest peak``: the chains' keep flags of ``convert(peak_budget=0.01)`` (a second,
  untimed conversion of a copy; its chains are matched by their first convolution's name);
* ``keep every conv output``: every layer keeps its conv output (``recompute_bn``
  everywhere: only element-wise work is recomputed);
* ``recompute every conv``: no layer keeps its conv output.

Step: ``zero_grad(set_to_none=True)``, forward, mean loss, backward (no optimizer step: the
plans do not change it); thread CPU time with one intra-op thread (else wall time), median over
interleaved rounds with the order rotated each round, after one warm-up step per row; ratio to
eager's median in the same run. Each row also gives the plan's recompute (the planner's extra
MACs). Run::

    python benchmarks/bm_norm_plans.py --nets unet3d --rounds 5
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bm_norm_nets import NETS  # noqa: E402

import convbn  # noqa: E402
from convbn.autograd.norm_chain_memory import norm_conv_runs  # noqa: E402
from convbn.nn.chain import FusedChain  # noqa: E402
from convbn.nn.norm_view import NormView  # noqa: E402
from convbn.passes.plan.chain_plans import chain_plan  # noqa: E402
from convbn.passes.report.live import all_chains  # noqa: E402

__all__ = ["plans_of", "main"]

Keeps = List[Tuple[bool, ...]]


def _converted(base: nn.Module, x: Tuple[torch.Tensor, ...], **kw: object) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a peak_budget below the floor warns: the lowest peak is asked
        return convbn.convert(copy.deepcopy(base), example_inputs=x, **kw).train()


def _first_names(chains: Sequence[FusedChain]) -> List[str]:
    return [c.layers[0].names[0] for c in chains]


def plans_of(base: nn.Module, x: Tuple[torch.Tensor, ...]) -> Tuple[nn.Module, List[FusedChain], Dict[str, Keeps]]:
    """The converted model, its chains and the four plans (keep flags per chain, in its order)."""
    model = _converted(base, x)
    chains = all_chains(model)
    low = all_chains(_converted(base, x, peak_budget=0.01))
    by_name = {n: tuple(c.plan.keep) for n, c in zip(_first_names(low), low)}
    if set(by_name) != set(_first_names(chains)):
        raise RuntimeError(f"the lowest-peak conversion has other chains: {sorted(by_name)} vs {_first_names(chains)}")
    return model, chains, {
        "default": [tuple(c.plan.keep) for c in chains],
        "lowest peak": [by_name[n] for n in _first_names(chains)],
        "keep every conv output": [(True,) * len(c.layers) for c in chains],
        "recompute every conv": [(False,) * len(c.layers) for c in chains],
    }


def _apply(chains: Sequence[FusedChain], keeps: Keeps) -> None:
    for c, k in zip(chains, keeps):
        c.apply_plan(chain_plan(k, list(c.plan.may_drop)))


def _clock() -> float:
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _step(model: nn.Module, x: Tuple[torch.Tensor, ...]) -> float:
    model.zero_grad(set_to_none=True)
    t = _clock()
    out = model(*x)
    (out if isinstance(out, torch.Tensor) else out[0]).float().mean().backward()
    return _clock() - t


def _extra_macs(chains: Sequence[FusedChain], keeps: Keeps) -> float:
    """The plan's recompute in GMAC: each layer's conv MACs times the runs its chain's backward
    makes of it again (:func:`~convbn.autograd.norm_chain_memory.norm_conv_runs` for a
    per-sample-norm chain, once per layer not keeping its output for a BatchNorm chain)."""
    total = 0
    for c, keep in zip(chains, keeps):
        ls = c.layers
        if any(isinstance(l.bn, NormView) for l in ls):
            norms = [l.bn.call().row if isinstance(l.bn, NormView) else "" for l in ls]
            runs = norm_conv_runs(keep, [l.tail_kind() for l in ls], norms, ls[0].is_head)
        else:
            runs = tuple(int(not k) for k in keep)
        total += sum(l.flops() * r for l, r in zip(ls, runs))
    return total / 1e9


def measure(net: str, rounds: int) -> str:
    """The table of one network."""
    factory, batch, label = NETS[net]
    torch.manual_seed(0)
    base, x, _ = factory(batch)
    base.train()
    model, chains, plans = plans_of(base, x)
    rows = ["eager", *plans]
    gmac = {n: _extra_macs(chains, k) for n, k in plans.items()}
    times: Dict[str, List[float]] = {n: [] for n in rows}

    def run(n: str) -> float:
        if n == "eager":
            return _step(base, x)
        _apply(chains, plans[n])
        return _step(model, x)

    for n in rows:  # warm-up
        run(n)
    for r in range(rounds):
        for n in rows[r % len(rows):] + rows[: r % len(rows)]:
            times[n].append(run(n))
    eager = statistics.median(times["eager"])
    lines = [f"**{label}, batch {batch}**", "",
             "| plan | recompute GMAC | step ms | time x eager |", "|---|---:|---:|---:|"]
    for n in rows:
        med = statistics.median(times[n])
        extra = "-" if n == "eager" else f"{gmac[n]:.2f}"
        lines.append(f"| {n} | {extra} | {med * 1e3:.0f} | {med / eager:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["unet3d"], choices=sorted(NETS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, but got {args.rounds}")
    torch.set_num_threads(1)
    print(f"Command: `python benchmarks/bm_norm_plans.py --nets {' '.join(args.nets)} --rounds {args.rounds}` "
          f"(torch {torch.__version__}, {torch.get_num_threads()} thread(s))\n")
    for net in args.nets:
        print(measure(net, args.rounds) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
