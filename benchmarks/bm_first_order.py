"""First-order training-step time: ``convbn.convert`` models vs the eager model.

Double backward support (Note: [double backward] in ``convbn/autograd/double_backward.py``) adds a
``torch.is_grad_enabled()`` branch to every fused backward. Ordinary training
(``loss.backward()`` without ``create_graph``) must keep taking the fast native path;
this benchmark times that path so before/after numbers can be compared.

fvcore style: each case has a setup factory (builds models, converts, makes inputs and
checks the gradients agree -- none of it timed) returning one step callable per variant;
the runner warms up, then times interleaved rounds (one step of every variant per round,
order rotated each round) so load from other processes on a shared machine hits all
variants alike. Reported: median step time, IQR, ratio of medians to eager, and the
median of the per-round (paired) ratios, which is the most noise-robust number.

A step is forward + backward with a fixed random upstream gradient (no optimizer step).

Run::

    python benchmarks/bm_first_order.py                       # mnist + monai:resnet18 (2-D)
    python benchmarks/bm_first_order.py --models mnist --batch-size 64 --repeats 30
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, get_args

import torch
from torch import nn

import convbn
from convbn.bench.models import build_model

__all__ = ["CASES", "Row", "setup_first_order_step", "run", "print_table", "main"]

#: (model spec, batch size, spatial size or None for the model's default) timed by default
CASES: List[Tuple[str, int, Optional[int]]] = [
    ("mnist", 64, None),
    ("monai:resnet18", 4, 112),
]
STRATEGIES = ("auto",)

Step = Callable[[], None]


@dataclass
class Row:
    model: str
    variant: str
    input_shape: Tuple[int, ...]
    median_ms: float
    iqr_ms: Tuple[float, float]
    ratio: float          # median / eager median
    paired_ratio: float   # median over rounds of (variant time / eager time in the same round)
    max_grad_diff: float  # largest |grad difference| to eager over all parameters (float32)
    fused_pairs: int      # Conv+BN pairs the variant fused (0 for eager)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup_first_order_step(
    spec: str, batch_size: int, image_size: Optional[int], strategies: Sequence[str], device: torch.device, seed: int = 0
) -> Tuple[Dict[str, Step], Tuple[int, ...], Dict[str, float], Dict[str, int]]:
    """Build the eager model and its converted twins.

    Returns:
        ``(steps, input_shape, max_grad_diff, fused_pairs)``, the last two per variant.

    Not timed. Every variant gets a deep copy of the same initial model, the same input and
    the same upstream gradient; one step of each is checked against eager before timing.
    """
    torch.manual_seed(seed)
    model, shape = build_model(spec)
    if image_size is not None and len(shape) > 1 and spec != "mnist":
        shape = (shape[0],) + (image_size,) * (len(shape) - 1)
    model = model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *shape, generator=gen).to(device)
    models: Dict[str, nn.Module] = {"eager": copy.deepcopy(model)}
    for s in strategies:
        models[f"convert({s})"] = convbn.convert(copy.deepcopy(model), strategy=s, example_inputs=x)
    with torch.no_grad():
        out_shape = model(x).shape
    upstream = torch.randn(out_shape, generator=gen).to(device)
    for m in models.values():
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0  # same computation in every variant without sharing RNG state

    def make_step(m: nn.Module) -> Step:
        params = list(m.parameters())

        def step() -> None:
            for p in params:
                p.grad = None
            m(x).backward(upstream)

        return step

    steps = {name: make_step(m) for name, m in models.items()}
    for step in steps.values():
        step()
    ref = [p.grad for p in models["eager"].parameters()]
    diffs = {
        name: max(float((p.grad - r).abs().max()) for p, r in zip(m.parameters(), ref))
        for name, m in models.items()
    }
    pairs = {name: len(getattr(getattr(m, "convbn_report", None), "pairs", ())) for name, m in models.items()}
    return steps, (batch_size, *shape), diffs, pairs


def _time_interleaved(steps: Dict[str, Step], warmup: int, repeats: int, device: torch.device) -> Dict[str, List[float]]:
    names = list(steps)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            _sync(device)
            start = time.perf_counter()
            steps[name]()
            _sync(device)
            if round_ >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def run(
    cases: Sequence[Tuple[str, int, Optional[int]]] = CASES,
    strategies: Sequence[str] = STRATEGIES,
    warmup: int = 3,
    repeats: int = 15,
    device: str = "cpu",
) -> List[Row]:
    dev = torch.device(device)
    rows: List[Row] = []
    for spec, batch, size in cases:
        steps, shape, diffs, pairs = setup_first_order_step(spec, batch, size, strategies, dev)
        times = _time_interleaved(steps, warmup, repeats, dev)
        base = statistics.median(times["eager"])
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
            paired = statistics.median(t / e for t, e in zip(ts, times["eager"]))
            rows.append(Row(spec, name, shape, statistics.median(ts), (q[0], q[2]), statistics.median(ts) / base,
                            paired, diffs[name], pairs[name]))
        print(f"done: {spec}", flush=True)
    return rows


def print_table(rows: Sequence[Row], title: str) -> None:
    headers = ["model", "variant", "input", "median ms", "IQR ms", "ratio", "paired ratio", "max |dgrad|", "fused pairs"]
    cells = [
        [r.model, r.variant, "x".join(map(str, r.input_shape)), f"{r.median_ms:.2f}",
         f"{r.iqr_ms[0]:.2f}-{r.iqr_ms[1]:.2f}", f"{r.ratio:.3f}", f"{r.paired_ratio:.3f}", f"{r.max_grad_diff:.1e}",
         str(r.fused_pairs)]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print(title)
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-+-".join("-" * w for w in widths))
    for c in cells:
        print(" | ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))


def _case(text: str) -> Tuple[str, int, Optional[int]]:
    """``SPEC[@BATCH[xSIZE]]``, e.g. ``mnist@64`` or ``monai:resnet18@4x112``."""
    spec, _, rest = text.partition("@")
    if not rest:
        return next(((s, b, z) for s, b, z in CASES if s == spec), (spec, 8, None))
    batch, _, size = rest.partition("x")
    return spec, int(batch), int(size) if size else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", type=_case, default=CASES, metavar="SPEC[@BATCH[xSIZE]]",
                        help="cases, e.g. mnist@64 monai:resnet18@4x112 (default: %(default)s)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=get_args(convbn.ConvertStrategy))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: least noise on shared CPUs)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.models, args.strategies, args.warmup, args.repeats, args.device)
    print_table(rows, f"First-order step (forward + backward), {args.device}, {args.threads} thread(s), "
                      f"torch {torch.__version__}, {args.repeats} interleaved rounds after {args.warmup} warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
