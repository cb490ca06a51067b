"""Tests for ``convbn.memory``: saved-bytes accounting and peak memory."""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function

from convbn.memory import PeakMemory, SavedBytes, format_bytes, peak_memory, saved_bytes, track_saved

F32 = torch.empty((), dtype=torch.float32).element_size()
F64 = torch.empty((), dtype=torch.float64).element_size()


class SaveTwice(Function):
    """Saves the same tensor twice (and a view of it once)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, x, x[1:])
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        return g * 2


def test_same_tensor_saved_twice_counts_once() -> None:
    x = torch.randn(10, 10, requires_grad=True)
    with track_saved() as rec:
        out = SaveTwice.apply(x)
    assert rec.result.total == 100 * F32
    assert rec.result.count == 1
    assert rec.result.shapes == [("", (10, 10), torch.float32, 100 * F32)]
    out.backward(torch.ones_like(out))  # the hooks handed the tensors back intact
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_mul_by_itself_counts_once() -> None:
    x = torch.randn(7, 3, requires_grad=True)
    r = saved_bytes(nn.Identity(), x, loss_fn=lambda y: (y * y).sum())
    assert r.total == 21 * F32 and r.count == 1


def test_views_count_their_whole_storage() -> None:
    base = torch.randn(8, 16, dtype=torch.float64)
    leaf = base.clone().requires_grad_()
    with track_saved() as rec:
        view = leaf[2:4]  # a view: 2x16 elements, storage 8x16
        out = view.exp() * view  # exp saves its output (fresh storage); mul saves the view and exp's output
    shapes = {s[1]: s[3] for s in rec.result.shapes}
    assert shapes[(2, 16)] in (8 * 16 * F64, 2 * 16 * F64)
    # the view of ``leaf`` keeps all of leaf's storage alive: counted in full
    view_entries = [s for s in rec.result.shapes if s[3] == 8 * 16 * F64]
    assert len(view_entries) == 1
    assert rec.result.total == 8 * 16 * F64 + 2 * 16 * F64
    del out


def test_two_views_of_one_storage_count_once() -> None:
    leaf = torch.randn(4, 6, requires_grad=True)
    with track_saved() as rec:
        a, b = leaf[:2], leaf[2:]
        out = a * b  # mul saves both views: same storage
    assert rec.result.count == 1
    assert rec.result.total == 24 * F32
    del out


def test_distinct_tensors_add_up() -> None:
    x = torch.randn(5, 4, requires_grad=True)
    lin = nn.Linear(4, 3)
    r = saved_bytes(lin, x, loss_fn=torch.sigmoid)
    # linear saves x (5x4) and the weight (as its 4x3 transpose view); sigmoid its output (5x3)
    assert r.total == (20 + 12 + 15) * F32
    assert r.count == 3
    assert sorted(s[1] for s in r.shapes) == sorted([(5, 4), (4, 3), (5, 3)])


def test_per_module_attribution() -> None:
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(4, 6, bias=False),
            block=nn.Sequential(OrderedDict(act=nn.Tanh(), fc2=nn.Linear(6, 2))),
        )
    )
    x = torch.randn(3, 4, requires_grad=True)
    r = saved_bytes(model, x, per_module=True)
    assert r.per_module == {
        "fc1": (3 * 4 + 6 * 4) * F32,  # input and weight
        "block.act": 3 * 6 * F32,  # tanh output
        "block.fc2": 2 * 6 * F32,  # weight (its input is tanh's output, counted under block.act)
    }
    assert r.total == sum(r.per_module.values())
    assert {m for m, *_ in r.shapes} == set(r.per_module)
    # without per_module everything goes to the root, same total
    r2 = saved_bytes(model, x)
    assert r2.total == r.total and set(r2.per_module) == {""}


def test_per_module_outside_any_module() -> None:
    """Tensors saved by ``loss_fn`` (outside the model's modules) go to the root ``""``."""
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 5)))
    r = saved_bytes(model, torch.randn(2, 4), per_module=True, loss_fn=torch.exp)
    assert r.per_module[""] == 2 * 5 * F32  # exp's output
    assert r.per_module["fc"] == 2 * 4 * F32  # the input only: it needs no grad, so no weight is kept


def test_hooks_removed_after_exit_and_on_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(RuntimeError, match="boom"):
        with track_saved(model):
            model(torch.randn(1, 2))
            raise RuntimeError("boom")
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    # no longer recording: a new saved tensor is not seen by the old recorder
    with track_saved(model) as rec:
        pass
    model(torch.randn(3, 2, requires_grad=True))
    assert rec.result == SavedBytes()


def test_no_grad_saves_nothing() -> None:
    with torch.no_grad(), track_saved() as rec:
        torch.randn(4, 4, requires_grad=True).exp()
    assert rec.result.total == 0 and rec.result.count == 0


def test_saved_bytes_enables_grad() -> None:
    """``saved_bytes`` measures the training forward even when called under no_grad."""
    with torch.no_grad():
        r = saved_bytes(nn.Linear(3, 3), torch.randn(2, 3))
    assert r.total == 6 * F32  # the input, for the weight's gradient


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(5 * 1024**2) == "5.0 MiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"
    assert format_bytes(4096 * 1024**3) == "4096.0 GiB"


# Note: the two RSS tests run in a fresh process. In a long test session the allocator
# may serve a 64 MiB block from pages already resident after earlier tests freed theirs,
# so process RSS (what this meter samples) need not grow at all: seen in the full suite.
# The "freed" case waits for the sampler itself, not for a time: until two samples began after
# the allocation (the first of them has then finished and been recorded), however loaded the
# machine; a fixed sleep would let a starved sampler thread miss the block.
_RSS_SCRIPT = """
import sys, time, torch
from convbn.memory import peak_memory, peaks
n = 64 * 1024 * 1024
samples = [0]
rss = peaks._rss_bytes


def counted():
    samples[0] += 1
    return rss()


peaks._rss_bytes = counted
if sys.argv[1] == "alive":
    with peak_memory("cpu") as pm:
        t = torch.ones(n // 4)
else:
    with peak_memory("cpu", interval=0.0005) as pm:
        t = torch.ones(n // 4)
        seen = samples[0]
        while samples[0] < seen + 2:
            time.sleep(0.001)
        del t
r = pm.result
print(r.source, r.peak, r.end)
"""


def _rss_in_fresh_process(case: str):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, case], capture_output=True, text=True, check=True,
                         timeout=600)  # a hang guard only
    source, peak, end = out.stdout.split()
    return source, int(peak), int(end)


def test_peak_memory_cpu_reports_rss() -> None:
    n = 64 * 1024 * 1024  # bytes, large enough to be mmap-ed (fresh pages, returned on free)
    source, peak, end = _rss_in_fresh_process("alive")
    assert source == "rss"
    # still alive at exit: both the end and the peak see it
    assert end >= n // 2, format_bytes(end)
    assert peak >= end


def test_peak_memory_cpu_sampler_sees_freed_memory() -> None:
    """Memory freed before the block ends is still caught by the background sampler."""
    n = 64 * 1024 * 1024
    source, peak, end = _rss_in_fresh_process("freed")
    assert peak >= n // 2, format_bytes(peak)
    assert end < peak


def test_peak_memory_idle_block_is_small() -> None:
    with peak_memory(torch.device("cpu")) as pm:
        time.sleep(0.01)
    assert pm.result.source == "rss"
    assert 0 <= pm.result.peak < 16 * 1024 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_cuda_allocator() -> None:
    dev = torch.device("cuda")
    with peak_memory(dev) as pm:
        t = torch.ones(1 << 20, device=dev)
        del t
    assert pm.result.source == "cuda"
    assert pm.result.peak >= (1 << 20) * F32
    assert pm.result.end == 0


def test_allocator_peak_counts_exact_bytes_freed_ones_and_compiled_buffers() -> None:
    from convbn.memory import allocator_peak

    def block() -> None:
        a = torch.empty(1 << 18)  # 1 MiB, freed before the next
        del a
        b = torch.empty(1 << 17)  # 0.5 MiB
        c = torch.empty(1 << 17)  # and 0.5 MiB more while b lives: 1 MiB, not 1.5
        del b, c

    assert allocator_peak(block) == 1 << 20
    # compiled code allocates outside the dispatcher; the allocator still sees its output
    x = torch.randn(1 << 16)
    f = torch.compile(lambda t: t * 2 + 1)
    f(x)
    assert allocator_peak(lambda: f(x)) == x.numel() * 4
    with pytest.raises(TypeError, match="callable"):
        allocator_peak(3)  # type: ignore[arg-type]
