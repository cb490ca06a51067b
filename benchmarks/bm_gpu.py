"""GPU training benchmark (CUDA only): peak memory, end-of-forward memory and step time of
eager vs ``convbn.convert`` vs checkpointing vs ``torch.compile``, in float32 and under AMP.

Every configuration is a deep copy of one freshly initialised model, measured in the same
process as eager, one after the other (the GPU is otherwise idle, so no round-robin is
needed), each after its own warm-up (compilation, cuDNN autotuning, allocator growth):

* **peak**: ``torch.cuda.max_memory_allocated`` over one training step (forward, loss,
  backward, ``SGD.step``) after ``reset_peak_memory_stats``, minus the memory allocated
  just before the step (weights, optimizer state and input are not counted);
* **fwd end**: memory allocated right after the forward, minus the same baseline: what the
  step keeps for backward (the tutorial's "memory held at the end of the forward pass");
* **step**: median of ``--steps`` CUDA-event timings of the same step after a synchronize.

AMP rows run the forward under ``torch.autocast("cuda", dtype)`` (weights float32); fp16
rows also scale the loss with ``torch.amp.GradScaler`` as AMP training does.

Modes::

    python benchmarks/bm_gpu.py table --model torchvision:resnet50 --batch-size 128 --amp none bf16 fp16
    python benchmarks/bm_gpu.py mnist --batch-size 2048
    python benchmarks/bm_gpu.py max-batch --model torchvision:resnet50
    python benchmarks/bm_gpu.py frontier --model torchvision:resnet50 --batch-size 128 --amp none bf16 fp16 --time-budget 1.05

``frontier`` is the (peak, time) plane of :mod:`convbn.bench.frontier_run` (eager, compile, compile
with activation budgets 0.5 and 0.3, per-block checkpointing, convbn's plans from the lowest
peak to eager's, each with and without compile; the frontier marked), one table per precision;
it also runs on the CPU (fp32 and bf16), e.g. the smoke run
``python benchmarks/bm_gpu.py frontier --device cpu --model mnist --batch-size 4 --amp none bf16 --no-compile --steps 1 --warmup 1 --plans 1``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
from torch import Tensor, nn

import convbn
from convbn.autograd.chain_compiled import compile_chains_mode
from convbn.bench.common import backward_and_step
from convbn.bench.models import build_model
from convbn.bench.training import budget_backend, checkpoint_blocks

DEFAULT_CHAINS = compile_chains_mode()  # convbn's default (or CONVBN_COMPILE_CHAINS), before any config sets one
AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = ("eager", "auto", "auto:peak0.45", "auto:peak0.6", "budget", "tutorial", "checkpoint", "compile",
           "compile0.5", "compile0.3", "compile0.1", "convert+compile", "convert+compile:op", "convert+compile:inductor")


@dataclass
class Row:
    model: str
    batch: int
    amp: str
    config: str
    peak_gib: float = float("nan")
    fwd_end_gib: float = float("nan")
    step_ms: float = float("nan")
    peak_ratio: float = float("nan")
    fwd_ratio: float = float("nan")
    time_ratio: float = float("nan")
    max_dout: float = float("nan")
    note: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


def _floor_budget(model: nn.Module, x: Tensor) -> float:
    """The lowest ``memory_budget`` convert accepts on this model (its floor, rounded up)."""
    report = convbn.explain(model, example_inputs=x)
    return float(f"{report.floor_saved_bytes / report.eager_saved_bytes + 0.0005:.3f}")


def build_config(name: str, base: nn.Module, x_plan: Tensor) -> nn.Module:
    model = copy.deepcopy(base)
    if name == "eager":
        return model
    if name == "auto":
        return convbn.convert(model, example_inputs=x_plan)
    if name.startswith("auto:peak"):  # the least recompute whose predicted peak fits this fraction of eager's
        return convbn.convert(model, example_inputs=x_plan, peak_budget=float(name[len("auto:peak"):]))
    if name == "budget":
        return convbn.convert(model, example_inputs=x_plan, memory_budget=_floor_budget(model, x_plan))
    if name == "tutorial":
        return convbn.convert(model, strategy="recompute_conv", chain=False)
    if name == "checkpoint":
        return checkpoint_blocks(model)
    if name == "compile":
        return torch.compile(model)
    if name.startswith("compile"):
        return torch.compile(model, backend=budget_backend(float(name[len("compile"):])))
    if name.startswith("convert+compile"):  # ":op" / ":inductor", or the default (Note: [a chain inductor can see into])
        mode = name.partition(":")[2] or DEFAULT_CHAINS
        compiled = torch.compile(convbn.convert(model, example_inputs=x_plan))
        compiled.__dict__["_bm_chains"] = mode  # compiled on its first step: Stepper.context sets the mode
        return compiled
    raise ValueError(f"unknown configuration {name!r}; choose from {CONFIGS}")


class Stepper:
    """One training step of ``model`` (forward under autocast, projection loss, backward, SGD)."""

    def __init__(self, model: nn.Module, amp: Optional[torch.dtype], proj: Tensor) -> None:
        self.model = model
        self.amp = amp
        self.proj = proj
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cuda") if amp is torch.float16 else None

    def context(self) -> ContextManager[Any]:
        stack = contextlib.ExitStack()
        if self.amp is not None:
            stack.enter_context(torch.autocast("cuda", dtype=self.amp))
        mode = self.model.__dict__.get("_bm_chains")
        if mode is not None:  # a recompile (another grad mode) traces with this model's mode too
            stack.enter_context(convbn.compile_chains(mode))
        return stack

    def __call__(self, x: Tensor, on_forward_end: Optional[Callable[[Tensor], None]] = None) -> Tensor:
        with self.context():
            out = self.model(x)
        if on_forward_end is not None:
            on_forward_end(out)
        backward_and_step((out.float() * self.proj[: out.shape[0]]).sum() / out.shape[0], self.opt, self.scaler)
        self.opt.zero_grad(set_to_none=True)
        return out.detach()


def measure(step: Stepper, x: Tensor, steps: int, warmup: int) -> Dict[str, float]:
    for _ in range(warmup):
        step(x)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    held: List[int] = []
    step(x, lambda out: held.append(torch.cuda.memory_allocated() - start))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        step(x)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return dict(peak=peak, fwd_end=held[0], ms=statistics.median(times))


def profile(step: Stepper, x: Tensor, path: str, steps: int = 3) -> None:
    """Write the CUDA kernels of ``steps`` training steps, by total device time, to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x)
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90))


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_table(spec: str, batch: int, image_size: Optional[int], amps: List[str], configs: List[str],
              steps: int, warmup: int, profile_dir: Optional[str] = None) -> List[Row]:
    torch.manual_seed(0)
    base, shape = build_model(spec)
    if image_size is not None:
        shape = (shape[0],) + (image_size,) * (len(shape) - 1)
    base = base.cuda().train()
    x = torch.randn(batch, *shape, device="cuda")
    x_plan = x[: min(batch, 32)]
    rows: List[Row] = []
    for amp in amps:
        eager_row: Optional[Row] = None
        ref_out: Optional[Tensor] = None
        for name in configs:
            row = Row(spec, batch, amp, name)
            try:
                torch._dynamo.reset()
                model = build_config(name, base, x_plan)
                with torch.no_grad():
                    proj = torch.randn(batch, *_out_shape(base, x_plan, AMP[amp]), device="cuda",
                                       generator=torch.Generator("cuda").manual_seed(1))
                step = Stepper(model, AMP[amp], proj)
                torch.manual_seed(2)
                first = step(x)  # the first step: same weights and input for every config
                if ref_out is None:
                    ref_out = first.float()
                row.max_dout = (first.float() - ref_out).abs().max().item()
                r = measure(step, x, steps, warmup)
                row.peak_gib, row.fwd_end_gib, row.step_ms = r["peak"] / 2**30, r["fwd_end"] / 2**30, r["ms"]
                if profile_dir is not None:
                    profile(step, x, f"{profile_dir}/{amp}_{name.replace(':', '-')}.txt")
                if name == "budget":
                    row.note = f"memory_budget={_floor_budget(copy.deepcopy(base), x_plan)}"
            except torch.OutOfMemoryError as exc:
                row.note = f"OOM: {str(exc).splitlines()[0][:80]}"
            except Exception as exc:  # a failing configuration is a row, not a lost run
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            finally:
                model = step = None  # type: ignore[assignment]
                _free()
            if name == "eager":
                eager_row = row
            if eager_row is not None:
                row.peak_ratio = row.peak_gib / eager_row.peak_gib
                row.fwd_ratio = row.fwd_end_gib / eager_row.fwd_end_gib
                row.time_ratio = row.step_ms / eager_row.step_ms
            rows.append(row)
            print(_fmt_row(row), flush=True)
    return rows


def _out_shape(model: nn.Module, x: Tensor, amp: Optional[torch.dtype]) -> tuple:
    m = copy.deepcopy(model).eval()
    with torch.no_grad(), (torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext()):
        out = m(x[:1])
    return tuple(out.shape[1:])


def _fmt_row(r: Row) -> str:
    return (f"| {r.model} | {r.batch} | {r.amp} | {r.config} | {r.peak_gib:.2f} | {r.peak_ratio:.2f} | "
            f"{r.fwd_end_gib:.2f} | {r.fwd_ratio:.2f} | {r.step_ms:.1f} | {r.time_ratio:.2f} | {r.max_dout:.1e} | {r.note} |")


HEADER = ("| model | batch | amp | config | peak GiB | peak × | fwd-end GiB | fwd-end × | step ms | time × | max Δout | note |\n"
          "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")


def _fits(make: Callable[[], nn.Module], shape: tuple, out_shape: tuple, batch: int,
          amp: Optional[torch.dtype]) -> bool:
    model = x = proj = step = None
    try:
        model = make()
        x = torch.randn(batch, *shape, device="cuda")
        proj = torch.ones(batch, *out_shape, device="cuda")
        step = Stepper(model, amp, proj)
        step(x)
        step(x)  # a second step: optimizer state allocated, steady state
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model = x = proj = step = None  # type: ignore[assignment]
        _free()


def run_max_batch(spec: str, image_size: Optional[int], amp: str, start: int, step_size: int,
                  only: Optional[str] = None) -> List[Row]:
    """The largest batch (multiple of ``step_size``) that trains two steps without OOM, per config
    (``only``: one of eager / auto / budget / checkpoint). Run one configuration per process
    (``main`` does): memory held after failed out-of-memory trials skews later ones."""
    torch.manual_seed(0)
    base, shape = build_model(spec)
    if image_size is not None:
        shape = (shape[0],) + (image_size,) * (len(shape) - 1)
    base = base.cuda().train()
    x_plan = torch.randn(32, *shape, device="cuda")
    floor = _floor_budget(copy.deepcopy(base), x_plan)
    out_shape = _out_shape(base, x_plan, AMP[amp])
    makers: Dict[str, Callable[[], nn.Module]] = {
        "eager": lambda: copy.deepcopy(base),
        "auto": lambda: convbn.convert(copy.deepcopy(base), example_inputs=x_plan),
        f"budget={floor} (floor)": lambda: convbn.convert(copy.deepcopy(base), example_inputs=x_plan,
                                                        memory_budget=floor),
        "checkpoint": lambda: checkpoint_blocks(copy.deepcopy(base)),
    }
    if only is not None:
        makers = {k: v for k, v in makers.items() if k.split(" ")[0].split("=")[0] == only}
    rows = []
    for name, make in makers.items():
        lo, hi = 0, start
        while _fits(make, shape, out_shape, hi, AMP[amp]):  # grow until the first failure
            lo, hi = hi, hi * 2
        while hi - lo > step_size:
            mid = (lo + hi) // 2 // step_size * step_size
            if mid <= lo:
                break
            if _fits(make, shape, out_shape, mid, AMP[amp]):
                lo = mid
            else:
                hi = mid
        row = Row(spec, lo, amp, name, note=f"largest batch that trains (OOM at {hi})")
        rows.append(row)
        print(f"| {spec} | {amp} | {name} | {lo} | {hi} |", flush=True)
    eager = rows[0].batch
    for r in rows:
        r.extra["vs_eager"] = r.batch / eager if eager else float("nan")
    return rows


def run_mnist(batch: int, steps: int, warmup: int) -> List[Row]:
    return run_table("mnist", batch, None, ["none"], ["eager", "auto", "tutorial"], steps, warmup)


def run_frontier_mode(args: argparse.Namespace) -> int:
    """One frontier table per ``--amp`` precision (``none`` = fp32), every point side by side."""
    from convbn.bench.frontier import frontier_table
    from convbn.bench.frontier_run import FrontierSettings, run_frontier

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bm_gpu: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    base, shape = build_model(args.model)
    if args.image_size:
        shape = (shape[0],) + (args.image_size,) * (len(shape) - 1)
    base = base.to(args.device).train()
    x = torch.randn(args.batch_size, *shape, device=args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# {name} | torch {torch.__version__} | convbn {convbn.__version__} | {args.model} input "
          f"{'x'.join(map(str, x.shape))} | {args.steps} interleaved rounds")
    for amp in args.amp:
        precision = {"none": "fp32"}.get(amp, amp)
        settings = FrontierSettings(precision=precision, compile=not args.no_compile, plans=args.plans,
                                    time_budgets=tuple(args.time_budget), rounds=args.steps, warmup=args.warmup)
        points = run_frontier(base, x, settings)
        print(f"\n## {precision}\n")
        print(frontier_table(points), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("mode", choices=("table", "mnist", "max-batch", "frontier"))
    p.add_argument("--model", default="torchvision:resnet50", help="model spec (convbn.bench.models)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--amp", nargs="+", choices=tuple(AMP), default=["none"])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-batch-start", type=int, default=256)
    p.add_argument("--max-batch-step", type=int, default=16)
    p.add_argument("--max-batch-config", choices=("eager", "auto", "budget", "checkpoint"), default=None,
                   help="max-batch: search this configuration only (in this process)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="table: also write each configuration's CUDA kernels (torch.profiler) to DIR")
    p.add_argument("--device", default="cuda", help="frontier: the device (cpu for a smoke run)")
    p.add_argument("--plans", type=int, default=3, help="frontier: convbn plans from the lowest peak to eager's")
    p.add_argument("--time-budget", type=float, action="append", default=[], help="frontier: add convert(time_budget=T)")
    p.add_argument("--no-compile", action="store_true", help="frontier: leave out the torch.compile configurations")
    args = p.parse_args(argv)
    if args.mode == "frontier":
        return run_frontier_mode(args)
    if not torch.cuda.is_available():
        print("bm_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    if args.max_batch_config is None:
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | convbn {convbn.__version__}")
    if args.mode == "table":
        print(HEADER)
        rows = run_table(args.model, args.batch_size, args.image_size, args.amp, args.configs, args.steps, args.warmup,
                         args.profile)
    elif args.mode == "mnist":
        print(HEADER)
        rows = run_mnist(args.batch_size, args.steps, args.warmup)
    else:
        rows = []
        if args.max_batch_config is None:  # one fresh process per configuration
            print("| model | amp | config | largest batch | OOM at |\n|---|---|---|---:|---:|", flush=True)
            import subprocess

            for amp in args.amp:
                for cfg in ("eager", "auto", "budget", "checkpoint"):
                    subprocess.run([sys.executable, __file__, "max-batch", "--model", args.model, "--amp", amp,
                                    "--max-batch-start", str(args.max_batch_start),
                                    "--max-batch-step", str(args.max_batch_step), "--max-batch-config", cfg]
                                   + (["--image-size", str(args.image_size)] if args.image_size else []), check=False)
        else:
            for amp in args.amp:
                rows += run_max_batch(args.model, args.image_size, amp, args.max_batch_start, args.max_batch_step,
                                      args.max_batch_config)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
