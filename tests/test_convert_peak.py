"""``convert(model, example_inputs=x)``'s own peak against one eager training step's (issue 41
item 1): the allocator's peak over the whole call, above what was live before it, at most the
peak of one standard training step (``zero_grad(set_to_none=True)``, forward, mean loss,
backward, SGD step with momentum) where activations make most of the step: the check's eager
side is taken within a training step's peak (Note: [the eager reference within a training
step's peak]: no output and no copy of the BatchNorm statistics held at it), and the rewrite's
step and the planner's recorded slices peak lower. The bound is exact, on a torchvision-style
ResNet at 96x96 (in the default run) and on torchvision's ResNet-18 b16 and ResNet-50 b8 at
224x224 (``slow``), with the check on the first samples of the batch (Note: [the check on a
slice of the batch]) and with the check at the example batch, where it runs wherever a slice
cannot stand for the batch (a graph traced with real shapes, a model refusing the slice, an
accelerator). Where the parameters outweigh the activations, the eager gradients not yet
compared sit beside the rewrite's step (Notes: [a check that holds one side's gradients], [the
check runs the plan that keeps least]). CPU: every allocation and free the CPU allocator reports
(:func:`convbn.memory.allocator_peak`), exact bytes; the same on CUDA with the allocator's peak."""
from __future__ import annotations

import gc
from typing import Any, List, Tuple

import pytest
import torch
from torch import nn

import convbn
from convbn.memory import allocator_peak
from convbn.passes.check import slice_check
from fusion_checks import assert_fused


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def _resnet(w: int) -> nn.Module:
    """A torchvision-style ResNet (stem, four stages of basic blocks, pooled head), width ``w``."""
    return nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         _Block(w, w, 1), _Block(w, 2 * w, 2), _Block(2 * w, 4 * w, 2), _Block(4 * w, 8 * w, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * w, 10))


def _peaks(model: nn.Module, x: torch.Tensor) -> Tuple[int, int, Any]:
    """(one eager training step's peak, convert's peak, the converted model)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(inputs: torch.Tensor = x) -> None:
        opt.zero_grad(set_to_none=True)
        model(inputs).float().mean().backward()
        opt.step()

    # the momentum buffers exist before the measured step, as in training; they are the
    # parameters' shape, so a one-sample step makes them (the measured step's bytes are the same
    # as after a full-batch step: checked on these ResNets) at a fraction of a full step's time
    step(x[:1])
    eager = allocator_peak(step)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    held: List[Any] = []
    peak = allocator_peak(lambda: held.append(convbn.convert(model, example_inputs=x, progress=False)))
    return eager, peak, held[0]


def _allowance(model: nn.Module, x: torch.Tensor) -> int:
    """What convert's check holds beside the rewrite's step, exact bytes: the eager output, kept
    to be compared with the rewrite's, and one buffer set (eager's buffers after its step; the
    snapshot's copy is below the eager gradients already compared). Nothing else: no second copy
    of the statistics, no upstream gradient held through the backward, no random-number
    generator state."""
    with torch.no_grad():
        out = model.eval()(x[:1])
    model.train()
    out_bytes = out.numel() // out.shape[0] * x.shape[0] * out.element_size()
    return sum(b.numel() * b.element_size() for b in model.buffers()) + out_bytes


@pytest.mark.parametrize("check_at", ["slice", "example batch"])
def test_convert_peaks_within_one_eager_training_step(check_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where activations make most of the step (a training batch), convert's peak is eager's,
    with the check on a slice of the batch and at the batch itself."""
    if check_at == "example batch":
        monkeypatch.setattr(slice_check, "MIN_BATCH", 10 ** 9)
    torch.manual_seed(0)
    model = _resnet(16)
    x = torch.randn(8, 3, 96, 96)
    eager, peak, fast = _peaks(model, x)
    assert_fused(fast, pairs=12)
    assert fast.convbn_report.validated == [""]  # the check ran, on the whole model
    assert peak <= eager, (peak / eager, peak - eager)


def test_convert_peak_where_weights_dominate_is_within_one_copy_of_their_gradients() -> None:
    """Where the parameters outweigh the activations (a small batch of small images), the eager
    gradients still to compare sit beside the rewrite's step: at most one copy of the parameters'
    bytes above eager's step (Note: [a check that holds one side's gradients]; on CUDA they wait
    in host memory)."""
    torch.manual_seed(0)
    model = _resnet(32)
    x = torch.randn(8, 3, 64, 64)
    eager, peak, fast = _peaks(model, x)
    assert fast.convbn_report.validated == [""]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak <= eager + params + _allowance(model, x), (peak / eager, peak - eager, params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_convert_peaks_within_one_eager_training_step_on_cuda() -> None:
    torch.manual_seed(0)
    model = _resnet(32).cuda()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def peak_of(fn: Any) -> int:  # the allocator's events: max_memory_allocated is reset inside convert
        torch.cuda.synchronize()
        return allocator_peak(lambda: (fn(), torch.cuda.synchronize()), "cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().mean().backward()
        opt.step()

    step()
    eager = peak_of(step)
    opt.zero_grad(set_to_none=True)
    held: List[Any] = []
    peak = peak_of(lambda: held.append(convbn.convert(model, example_inputs=x, progress=False)))
    assert peak <= eager + _allowance(model, x), (peak / eager, peak - eager)


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [("resnet18", (16, 3, 224, 224)), ("resnet50", (8, 3, 224, 224))])
def test_convert_peak_on_torchvision_resnets_at_a_training_batch(name: str, shape: Tuple[int, ...]) -> None:
    """The issue's models (BENCHMARKS.md "convert's own cost"): torchvision ResNet-18 b16 and
    ResNet-50 b8 at 224x224, the same exact bound: convert / eager step peak <= 1.0."""
    from zoo import import_torchvision_without_fake_kernels

    torch.manual_seed(0)
    model = getattr(import_torchvision_without_fake_kernels().models, name)()
    x = torch.randn(shape)
    eager, peak, fast = _peaks(model, x)
    assert fast.convbn_report.validated == [""]
    assert peak <= eager, (peak / eager, peak - eager)
