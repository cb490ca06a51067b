"""convert + torch.compile against torch.compile alone, on the CPU: step time and saved bytes.

Configurations (each a deep copy of one model, compiled with ``fullgraph=False``):
``compile`` (eager model), ``compile0.5`` (activation memory budget 0.5), ``convert+compile``
with the chains as the opaque custom op (``set_compile_chains("op")``) and as ops inductor
fuses (``"inductor"``, Note: [a chain inductor can see into]). Per configuration: thread CPU
time of one training step (forward + backward, median of interleaved rounds after warm-up),
the bytes saved for backward (distinct storages saved by the compiled graphs, parameters
excluded), and the first step's largest output / gradient difference from eager.

    python benchmarks/bm_compile_chains.py --model torchvision:resnet18 --batch-size 8 --image-size 112
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any, Callable, Dict

import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.models import build_model  # noqa: E402
from convbn.autograd.chain_compiled import set_compile_chains  # noqa: E402
from convbn.bench.training import budget_backend  # noqa: E402
from convbn.memory import saved_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision:resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model.startswith("torchvision:"):
        import_torchvision_without_fake_kernels()  # torchvision's CPU wheel: model code only (tests/zoo.py)
    base, shape = build_model(args.model)
    shape = (shape[0],) + (args.image_size,) * (len(shape) - 1)
    x = torch.randn(args.batch_size, *shape)
    configs: Dict[str, Callable[[], Any]] = {
        "eager": lambda: copy.deepcopy(base),
        "compile": lambda: torch.compile(copy.deepcopy(base)),
        "compile0.5": lambda: torch.compile(copy.deepcopy(base), backend=budget_backend(0.5)),
        "convert+compile (op)": lambda: torch.compile(convbn.convert(copy.deepcopy(base), example_inputs=x)),
        "convert+compile (inductor)": lambda: torch.compile(convbn.convert(copy.deepcopy(base), example_inputs=x)),
    }
    models, steps, info = {}, {}, {}
    ref = None
    for name, make in configs.items():
        set_compile_chains("inductor" if "(inductor)" in name else "op")  # read when the graph is traced, below
        t0 = time.time()
        m = make()
        xx = x.clone().requires_grad_()
        torch.manual_seed(1)
        out = m(xx)
        out.backward(torch.ones_like(out))
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        if ref is None:
            ref = (out.detach(), grads)
        dout = (out.detach() - ref[0]).abs().max().item()
        dgrad = max((a - b).abs().max().item() for a, b in zip(grads, ref[1]))
        info[name] = dict(saved=saved_bytes(m, x).activation_bytes, dout=dout, dgrad=dgrad, build_s=time.time() - t0)
        m.zero_grad(set_to_none=True)
        models[name] = m
        steps[name] = []

    def step(m: Any) -> None:
        out = m(x)
        out.sum().backward()
        m.zero_grad(set_to_none=True)

    for r in range(args.rounds):
        names = list(models)
        names = names[r % len(names):] + names[: r % len(names)]
        for n in names:
            t = time.thread_time()
            step(models[n])
            steps[n].append(time.thread_time() - t)
    e = statistics.median(steps["eager"])
    c = statistics.median(steps["compile"])
    se = info["eager"]["saved"]
    print(f"# {args.model} b{args.batch_size} {args.image_size}px, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds (thread CPU time)")
    print("| config | CPU ms | x eager | x compile | saved MiB | saved x eager | max dout | max dgrad |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in models:
        t = statistics.median(steps[n])
        i = info[n]
        print(f"| {n} | {t * 1e3:.1f} | {t / e:.3f} | {t / c:.3f} | {i['saved'] / 2**20:.1f} | {i['saved'] / se:.2f} | "
              f"{i['dout']:.1e} | {i['dgrad']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
