"""A training dropout in a per-sample-norm chain's tail (issue 39): diffusers' ``UNet3DConditionModel`` (the
sixth sweep's ``diff2`` build; its ``TemporalConvLayer``: GroupNorm -> SiLU -> Dropout(0.1) -> Conv3d), converted
with ``example_inputs`` in training mode. Prints what the report says per norm, the fused chain calls in one
step's autograd graph, whether one float32 training step from one RNG seed equals eager's (output, every
gradient, the global RNG state after), and the step's peak (exact bytes on the CPU, Note: the standard training
loop: ``convbn.passes.plan.plan_inputs.measure_peak``), eager beside convert. Nothing is timed.

    PYTHONPATH=src:tests:benchmarks python benchmarks/bm_norm_dropout.py
"""
from __future__ import annotations

import collections
import copy
import sys
from typing import Any, List

import torch

# transformers (imported by diffusers' loaders) imports torchvision for image utilities the UNet does not use;
# kept out, so that a torchvision built for another torch does not stop the build
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]

import convbn  # noqa: E402
from convbn.passes.plan.plan_inputs import measure_peak  # noqa: E402
from fusion_checks import chain_nodes  # noqa: E402
from sweep_norm_libs import build_norm  # noqa: E402


def _step(model: Any, x: Any) -> List[Any]:
    torch.manual_seed(5)
    out = model(*x)[0]
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    res = [out.detach(), *(p.grad for p in model.parameters()), torch.get_rng_state()]
    model.zero_grad(set_to_none=True)
    return res


def main() -> None:
    model, x = build_norm("diff2", "UNet3DConditionModel", torch.Generator().manual_seed(0))
    model.train()
    eager = copy.deepcopy(model)
    fast = convbn.convert(model, example_inputs=tuple(x))
    for (result, why), n in collections.Counter((o.result, o.reason or "") for o in fast.convbn_report.outcomes).items():
        print(f"{n:4d} {result}{': ' + why[:100] if why else ''}")
    torch.manual_seed(5)
    print("fused chain calls in one step's graph:", len(chain_nodes(fast(*x)[0])))
    a, b = _step(fast, x), _step(eager, x)
    same = all((p is None and q is None) or (p is not None and q is not None and torch.equal(p, q)) for p, q in zip(a, b))
    print("one step bit-equal to eager's (output, every gradient, RNG state after):", same)
    pf, pe = measure_peak(fast, tuple(x)).peak, measure_peak(eager, tuple(x)).peak
    print(f"step peak: convert {pf} B, eager {pe} B, ratio {pf / pe:.3f}")


if __name__ == "__main__":
    main()
