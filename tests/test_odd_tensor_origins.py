"""Nothing convbn runs on a model can take the process down, whatever the tensors are.

A model's forward may hand convbn's hooks and measurements (``ModTracker`` / ``MemTracker``
through ``tensor_peak`` and ``timeline``, the auto planner's peak measurement, the checks) any
tensor: views of its inputs, a view changed in place through another alias (a
spectrogram-augmentation mask), outputs of custom autograd Functions (in place with
``mark_dirty``, non-differentiable ones), tensors made under ``no_grad``, detached ones,
complex tensors from ``torch.stft``, expanded views. Each scenario runs in a subprocess, so a
segmentation fault fails the test instead of killing pytest (Note: [a hook on a stale view
crashes the process] in ``memory/mod_tracking.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import convbn

pytest.importorskip("hypothesis")

#: a forward that leaves its output a view of a base changed in place through another alias
_ORIGINS = textwrap.dedent(
    '''
    import torch
    from torch import nn


    class Dirty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.mul_(1.5)

        @staticmethod
        def backward(ctx, g):
            return g * 1.5


    class WithMask(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            mask = x > 0
            ctx.mark_non_differentiable(mask)
            return x * 2, mask

        @staticmethod
        def backward(ctx, g, _gm):
            return g * 2


    def stale_view(x):  # SpecAugment-style masking, the output a view refreshed lazily
        x = x.clone().view(x.shape)
        x[:, :, 1:3].zero_()
        return x


    def spectrogram(x):  # complex STFT, power, back to (B, 1, F, T)
        b = x.shape[0]
        s = torch.stft(x.reshape(b, -1), 16, 4, window=torch.ones(16), return_complex=True)
        s = s.abs().pow(2)[:, :8, :8]
        return s.unsqueeze(1).expand(b, 2, 8, 8) + 0 * x.sum()


    ORIGINS = {
        "identity": lambda x: x,
        "view_of_input": lambda x: x.view(x.shape)[:, :],
        "stale_view": stale_view,
        "custom_function_dirty": lambda x: Dirty.apply(x.clone()),
        "custom_function_two_outputs": lambda x: WithMask.apply(x)[0],
        "no_grad": lambda x: _no_grad(x),
        "detached": lambda x: x.detach() * 1.0,
        "complex_stft": spectrogram,
        "expanded": lambda x: x[:, :1].expand(x.shape),
        "inplace_on_input_clone": lambda x: x.clone().add_(1.0),
        "transposed_twice": lambda x: x.transpose(2, 3).transpose(2, 3),
    }


    def _no_grad(x):
        with torch.no_grad():
            return x * 2.0


    class Origin(nn.Module):
        def __init__(self, names):
            super().__init__()
            self.names = list(names)

        def forward(self, x):
            for name in self.names:
                x = ORIGINS[name](x)
            return x


    class Net(nn.Module):
        def __init__(self, names):
            super().__init__()
            self.stem = nn.Conv2d(2, 2, 1)
            self.origin = Origin(names)
            self.conv = nn.Conv2d(2, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(4)

        def forward(self, x):
            x = self.origin(self.stem(x))
            x = torch.relu(self.bn(self.conv(x)))
            return torch.relu(self.bn2(self.conv2(x))).mean((2, 3))
    '''
)

_SCRIPT = _ORIGINS + textwrap.dedent(
    '''
    import copy, json, sys
    import convbn
    from convbn.memory import tensor_peak, timeline
    from hypothesis import HealthCheck, given, settings, strategies as st

    seen = []
    names = st.lists(st.sampled_from(sorted(ORIGINS)), min_size=1, max_size=3)


    def one(chosen, strategy, with_inputs):
        torch.manual_seed(0)
        model = Net(chosen)
        twin = copy.deepcopy(model)
        x = torch.randn(2, 2, 8, 8)
        out = convbn.convert(model, example_inputs=(x,) if with_inputs else None, strategy=strategy)
        for m in (out, twin):
            m.zero_grad(set_to_none=True)
        y, y_eager = out(x.clone()), twin(x.clone())
        y.sum().backward()
        y_eager.sum().backward()
        assert torch.allclose(y, y_eager, atol=1e-5), (chosen, strategy, with_inputs)
        with tensor_peak(out):
            out(x.clone()).sum().backward()
        timeline(out, x.clone())
        seen.append([chosen, strategy, with_inputs])


    @settings(max_examples=int(sys.argv[1]), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(names, st.sampled_from(["auto", "recompute_bn", "recompute_conv"]), st.booleans())
    def fuzz(chosen, strategy, with_inputs):
        one(chosen, strategy, with_inputs)


    one(["stale_view"], "auto", True)  # the reported crash, always run
    fuzz()
    print(json.dumps({"ran": len(seen)}))
    '''
)


def _run(script: str, *argv: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(convbn.__file__)))  # this checkout's src/
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, (f"exit status {proc.returncode} (-11: segmentation fault)\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.expect_unfused("the fused models are converted and checked in a subprocess")
def test_odd_tensor_origins_never_crash_convert_or_the_measurements() -> None:
    result = _run(_SCRIPT, "30")
    assert result["ran"] >= 30


_HOOK_ONLY = _ORIGINS + textwrap.dedent(
    '''
    import json
    from convbn.memory.mod_tracking import releasing_mod_tracker
    base = torch.randn(2, 2, 8, 8, requires_grad=True)
    net = nn.Sequential(Origin(["stale_view"]), nn.Conv2d(2, 2, 1))
    with releasing_mod_tracker():
        net(base * 1.0).sum().backward()
    print(json.dumps({"grad": float(base.grad.abs().sum())}))
    '''
)


@pytest.mark.expect_unfused("a module tracker alone, nothing converted")
def test_module_tracker_on_a_stale_view_does_not_segfault() -> None:
    """The reported crash at its smallest: torch's ``register_multi_grad_hook(mode="any")`` on a
    module output that is a view changed through another alias."""
    assert _run(_HOOK_ONLY)["grad"] > 0


class _SparseNet:
    """Built lazily (torch imported in the test): a sparse buffer and a sparse parameter used by
    ``torch.sparse.mm`` before Conv1d -> BatchNorm1d and Linear -> BatchNorm1d."""

    @staticmethod
    def make() -> "torch.nn.Module":
        import torch
        from torch import nn

        class SparseNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                i = torch.tensor([[0, 1, 2], [1, 2, 0]])
                self.register_buffer("adj", torch.sparse_coo_tensor(i, torch.ones(3), (3, 3)))
                self.qs = nn.Parameter(torch.randn(3, 4).to_sparse())
                self.conv, self.bn2 = nn.Conv1d(3, 6, 1), nn.BatchNorm1d(6)
                self.lin, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)

            def forward(self, x: "torch.Tensor") -> "torch.Tensor":
                h = torch.sparse.mm(self.adj, x.transpose(0, 1).reshape(3, -1)).reshape(3, x.shape[0], 4).transpose(0, 1)
                h = h + torch.sparse.mm(self.qs, torch.ones(4, 4)).unsqueeze(0)
                y = torch.relu(self.bn2(self.conv(h)))
                return torch.relu(self.bn(self.lin(y.mean(1)))).sum(1)

        return SparseNet()


@pytest.mark.parametrize("strategy", ["auto", "recompute_bn"])
@pytest.mark.parametrize("with_inputs", [False, True])
def test_sparse_parameters_neither_break_the_checks_nor_the_planner(strategy: str, with_inputs: bool) -> None:
    """A sparse parameter's gradient is sparse (the checks compare it dense); convbn's memory
    meters count it as its indices and values, so the auto planner measures the step (torch's
    own meter cannot read a sparse tensor's storage: where one cannot be read, Note: [a step the
    meters cannot measure])."""
    import torch

    from bn_calls import eager_bn_calls

    torch.manual_seed(0)
    model = _SparseNet.make()
    torch.manual_seed(0)
    eager = _SparseNet.make()  # (torch cannot deepcopy a sparse Parameter)
    x = torch.randn(4, 3, 4)
    fast = convbn.convert(model, example_inputs=x if with_inputs else None, strategy=strategy)
    for _ in range(2):
        for m in (fast, eager):
            m.zero_grad(set_to_none=True)
        y, y_eager = fast(x), eager(x)
        y.sum().backward()
        y_eager.sum().backward()
        torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), fast.parameters()):
            torch.testing.assert_close(q.grad.to_dense(), p.grad.to_dense(), rtol=1e-4, atol=1e-5, msg=name)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused", "fused"]
    assert eager_bn_calls(fast, x) == 0
    if strategy == "auto" and with_inputs:  # the meters count a sparse gradient as its indices and values
        assert "could not be measured" not in fast.convbn_report.planning_note
        assert "could not be measured" not in str(fast.convbn_report)
