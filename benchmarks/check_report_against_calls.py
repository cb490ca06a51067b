"""demucs ``HDemucs`` (the third norm sweep's build): after each training step, the norms the
report lists as fused against the norms whose fused Function ran in that step (a counting probe
on ``FusedChain.forward``: the chain's output came from a fused Function), and what the report
says of ``encoder.2.norm1`` (captured for ``inject=None``, called with ``inject``).

    pip install --no-deps --target <libs> demucs==4.1.0 julius==0.2.8     # see sweep_norm_third.py
    PYTHONPATH=src:tests:benchmarks:<libs> OMP_NUM_THREADS=1 python benchmarks/check_report_against_calls.py [--example-inputs]
"""
from __future__ import annotations

import argparse
import collections
import warnings

import torch

import convbn
import sweep_norm_third
from convbn.nn.chain import FusedChain
from fusion_watch import FUSED_BACKWARDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example-inputs", action="store_true", help="convert with example_inputs")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ran: collections.Counter = collections.Counter()
    forward = FusedChain.forward

    def counting(self: FusedChain, *inputs: torch.Tensor) -> torch.Tensor:
        out = forward(self, *inputs)
        if type(out.grad_fn).__name__ in FUSED_BACKWARDS:
            ran.update(layer.names[1] for layer in self.layers if layer.names[1])
        return out

    FusedChain.forward = counting
    net, inputs = sweep_norm_third._demucs("HDemucs")(torch.Generator().manual_seed(0))
    warnings.simplefilter("ignore")
    fast = convbn.convert(net, example_inputs=inputs if args.example_inputs else None)
    for step in range(args.steps):
        ran.clear()
        out = fast(*inputs)
        (out.sum() if torch.is_tensor(out) else sum(o.sum() for o in out)).backward()
        report = {o.batchnorm: o for o in fast.convbn_report.outcomes}
        fused = {n for n, o in report.items() if o.result == "fused"}
        print(f"step {step}: report fused {len(fused)}, fused Function ran for {len(set(ran))}; reported fused, "
              f"not run: {sorted(fused - set(ran))}; run, not reported fused: {sorted(set(ran) - fused)}")
        norm1 = report.get("encoder.2.norm1")
        if norm1 is not None:
            print(f"  encoder.2.norm1: {norm1.result}: {norm1.reason[:160]}")


if __name__ == "__main__":
    main()
