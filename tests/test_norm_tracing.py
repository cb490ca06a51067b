"""Tracing what diffusion U-Nets write (diffusers' ``UNet2DModel`` called as ``model(x, t)``):
a block's ``*args`` / ``**kwargs`` traced as the call passes them, guarded (Note: [``*args``
traced as the call passes them] in graph/specialize.py), and ``torch.is_tensor`` on a traced
tensor answered True (Note: [is_tensor on a traced tensor is True] in tracing/trace.py)."""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Optional, Union

import pytest
import torch
from torch import nn

import convbn
from fusion_checks import assert_chain_ran
from convbn.passes.graph.specialize import EmptyVarargs
from convbn.passes.tracing.trace import LayerTracer, TraceHazard, trace


class ResBlock(nn.Module):
    """diffusers' ``ResnetBlock2D`` shape: ``forward(x, temb, *args, **kwargs)`` asking ``len(args)``."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.temb = nn.Linear(16, c)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, temb: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        scale = args[0] if len(args) > 0 else kwargs.get("scale", 1.0)
        h = self.conv1(self.act(self.norm1(x))) + self.temb(temb)[:, :, None, None]
        return x + self.conv2(self.act(self.norm2(h))) * scale


class TinyUNet(nn.Module):
    """``UNet2DModel``'s root: the timestep a tensor or a number, ``torch.is_tensor`` on it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.block = ResBlock()
        self.emb = nn.Linear(1, 16)
        self.norm_out, self.conv_out = nn.GroupNorm(4, 8), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: Union[torch.Tensor, float, int],
                class_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([timestep], dtype=torch.long, device=sample.device)
        elif torch.is_tensor(timestep) and len(timestep.shape) == 0:
            timestep = timestep[None]
        timestep = timestep * torch.ones(sample.shape[0], dtype=timestep.dtype, device=timestep.device)
        temb = self.emb(timestep[:, None].to(sample.dtype))
        h = self.block(self.conv_in(sample), temb)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


class DictUNet(TinyUNet):
    """Returns its output in a mapping type of its own (diffusers' ``UNet2DOutput``, HF ``ModelOutput``)."""

    def forward(self, sample: torch.Tensor, timestep: Union[torch.Tensor, float, int]) -> Any:  # type: ignore[override]
        return OrderedDict(sample=super().forward(sample, timestep))


def _twins(make: Any) -> tuple:
    torch.manual_seed(0)
    eager = make().double()
    return eager, copy.deepcopy(eager)


def _step_matches(eager: nn.Module, fast: nn.Module, *args: Any, **kwargs: Any) -> None:
    out_e, out_f = eager(*args, **kwargs), fast(*args, **kwargs)
    if isinstance(out_e, dict):
        assert type(out_f) is type(out_e)
        out_e, out_f = out_e["sample"], out_f["sample"]
    assert_chain_ran(out_f)
    out_e.sum().backward()
    out_f.sum().backward()
    torch.testing.assert_close(out_f, out_e, rtol=1e-10, atol=1e-10)
    for (n, p), q in zip(eager.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10, msg=n)
    for m in (eager, fast):
        m.zero_grad(set_to_none=True)


def test_block_with_varargs_traced_alone_fuses_and_other_calls_run_its_own_forward() -> None:
    eager, work = _twins(ResBlock)
    x, temb = torch.randn(2, 8, 6, 6, dtype=torch.float64), torch.randn(2, 16, dtype=torch.float64)
    fast = convbn.convert(work)
    assert {o.batchnorm: o.result for o in fast.convbn_report.outcomes} == {"norm1": "fused", "norm2": "fused"}
    for _ in range(2):
        _step_matches(eager, fast, x, temb)
    # calls passing something to *args / **kwargs: the graph (traced with none) must not run
    for args, kwargs in (((2.0,), {}), ((), {"scale": 3.0})):
        torch.testing.assert_close(fast(x, temb, *args, **kwargs), eager(x, temb, *args, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize("make", [TinyUNet, DictUNet])
@pytest.mark.parametrize("example", [True, False])
def test_unet_called_with_a_timestep_tensor_fuses_its_root_norm(example: bool, make: Any) -> None:
    eager, work = _twins(make)
    x, t = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.tensor([3, 7])
    fast = convbn.convert(work, example_inputs=(x, t) if example else None)
    for _ in range(2):
        _step_matches(eager, fast, x, t)
    results = {o.batchnorm: o.result for o in fast.convbn_report.outcomes}
    assert results == {"block.norm1": "fused", "block.norm2": "fused", "norm_out": "fused"}, fast.convbn_report
    # a number as the timestep (the other branch of is_tensor): the model's own code, the same values
    torch.testing.assert_close(fast(x, 5), eager(x, 5), rtol=1e-10, atol=1e-10)


def test_is_tensor_on_an_input_traced_without_its_value_is_still_a_hazard() -> None:
    """``timestep`` may be a number: a symbolic trace cannot answer ``torch.is_tensor`` on it."""
    with pytest.raises(TraceHazard, match="isinstance"):
        trace(TinyUNet(), LayerTracer)
    t = torch.tensor([3, 7])
    traced = trace(TinyUNet(), LayerTracer, example=((torch.randn(2, 3, 6, 6), t), {}))
    assert not traced.guard().hold((torch.randn(2, 3, 6, 6), 5), {})  # a number there: not this graph


class Wrapper(nn.Module):
    """A training script's wrapper passing its ``*args`` on: ``forward(sample, *args)`` called as ``(x, t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyUNet()

    def forward(self, sample: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.inner(sample, *args, class_labels=None)


def test_wrapper_passing_star_args_on_is_traced_whole_with_example_inputs() -> None:
    eager, work = _twins(Wrapper)
    x, t = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.tensor([3, 7])
    fast = convbn.convert(work, example_inputs=(x, t))
    report = fast.convbn_report  # before any call: traced whole, as the example call passed *args
    assert not report.untraced, report.untraced
    assert {o.batchnorm: o.result for o in report.outcomes} == {
        "inner.block.norm1": "fused", "inner.block.norm2": "fused", "inner.norm_out": "fused"}
    for _ in range(2):
        _step_matches(eager, fast, x, t)
    guard = EmptyVarargs(1, ("sample",), 1)  # what the wrapper's trace assumed: one tensor in *args
    assert guard.hold((x, t), {}) and not guard.hold((x,), {}) and not guard.hold((x, t, t), {})
    assert not guard.hold((x, t), {"scale": 2.0})
