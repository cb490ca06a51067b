"""Answering max_batch holds no tensors above the memory asked about, and the meters it rests on
count what they say: Notes [stopping before the operator that would cross] (memory/next_op.py),
[answering within the limit] (batch_search.py), [blocks from before the measurement] (peaks.py).
"""
import warnings

import pytest
import torch
import torch.nn as nn

import convbn
import convbn.batch_search as batch_search
import convbn.largest_batch as largest_batch
from convbn.memory import allocator_peak, tensor_peak, timeline
from convbn.memory.next_op import new_output_bytes
import convbn.memory.timelines as timelines
from convbn.memory.allocator_meter import AllocatorCounters
from convbn.memory.timelines import StepOverLimit, _TimelineMode

from test_max_batch_predict import _resnet

aten = torch.ops.aten


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def test_new_output_bytes_are_the_new_storages_known_before_the_op_runs():
    a, b = torch.ones(4, 8), torch.ones(4, 8)
    assert new_output_bytes(aten.add.Tensor, (a, b)) == 4 * 8 * 4
    assert new_output_bytes(aten.add_.Tensor, (a, b)) == 0  # in place: the input's storage
    assert new_output_bytes(aten.view.default, (a, [32])) == 0  # a view
    assert new_output_bytes(aten.mm.default, (a, b.t())) == 4 * 4 * 4
    assert new_output_bytes(aten.empty.memory_format, ([3, 5],), {"dtype": torch.float64}) == 3 * 5 * 8
    w = torch.ones(2, 3, 3, 3)
    out, gi, gw = aten.convolution_backward.default(torch.ones(1, 2, 6, 6), torch.ones(1, 3, 8, 8), w, None,
                                                     [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    assert new_output_bytes(aten.convolution_backward.default, (torch.ones(1, 2, 6, 6), torch.ones(1, 3, 8, 8), w,
                                                                None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                                [True, True, False])) == out.nbytes + gi.nbytes
    assert new_output_bytes(aten.add.Tensor, (torch.ones(4).to_sparse(), torch.ones(4).to_sparse())) is None
    assert new_output_bytes(aten.nonzero.default, (a,)) is None  # a data-dependent shape: measured after


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
def test_a_stopped_step_never_allocates_above_the_limit(share):
    """Exact CPU allocator bytes: a step stopped at ``stop_above`` made no block above it (the
    operator that would cross never ran); fails with the stop before the operator removed."""
    net, x = _mlp(), torch.randn(32, 64)
    full = timeline(net, x)
    limit = int(full.peak * share) - 1
    stopped = []

    def step():
        with pytest.raises(StepOverLimit) as err:
            timeline(net, x, stop_above=limit)
        stopped.append(err.value)

    assert allocator_peak(step) <= limit
    assert stopped[0].before and stopped[0].bytes > limit


def test_the_stop_is_at_the_same_operator_before_or_after():
    net, x = _mlp(), torch.randn(32, 64)
    full = timeline(net, x)
    with pytest.raises(StepOverLimit) as err:
        timeline(net, x, stop_above=full.peak - 1)
    assert err.value.before and err.value.bytes == full.peak and err.value.point.op == full.peak_point.op


class _Reads:
    """Every reading of live bytes by every stopped-above step, and each step's limit."""

    def __init__(self, monkeypatch):
        self.most, self.limits = {}, set()
        real = _TimelineMode.__torch_dispatch__
        reads = self

        def dispatch(mode, func, types, args=(), kwargs=None):
            if mode.stop_above is not None and not getattr(mode, "_watched", False):
                mode._watched, inner = True, mode.read

                def read():
                    value = inner()
                    reads.most[mode.stop_above] = max(reads.most.get(mode.stop_above, 0), value)
                    return value

                mode.read = read
            return real(mode, func, types, args, kwargs)

        monkeypatch.setattr(_TimelineMode, "__torch_dispatch__", dispatch)


@pytest.mark.parametrize("method,confirm", [("predict", True), ("measure", None)])
def test_answering_holds_no_tensors_above_the_limit(monkeypatch, method, confirm):
    """Exact live tensor bytes after every operator of every step max_batch runs stay within
    ``memory - resident - the batch's inputs`` (the steps over it stopped before they crossed),
    with ``method="measure"`` too; fails with the stop before the operator removed."""
    reads = _Reads(monkeypatch)
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    fit = convbn.max_batch(net, torch.randn(2, 3, 16, 16), "2MiB", optimizer=opt, method=method, confirm=confirm)
    assert fit.sample_bytes == 3 * 16 * 16 * 4
    stepped = {b for side in fit.probes.values() for b in side}
    rooms = {fit.usable - fit.resident - b * fit.sample_bytes for b in stepped}
    assert set(reads.most) <= rooms and len(reads.most) > 3  # each step ran against the room its batch left
    assert all(most <= room for room, most in reads.most.items())
    for side, batch in (("eager", fit.eager_batch), ("convbn", fit.convbn_batch)):
        peak = {"eager": fit.eager_peak, "convbn": fit.convbn_peak}[side]
        assert fit.resident + batch * fit.sample_bytes + peak <= fit.usable
        assert fit.resident + (batch + 1) * fit.sample_bytes + fit.probes[side][batch + 1] > fit.usable
    assert fit.convbn_batch > fit.eager_batch > 6


def test_measure_converts_once_per_side(monkeypatch):
    """``method="measure"`` steps the batch-2 conversion planned per batch: it no longer
    converts (and checks) a copy at each batch it tries, which went far above the limit."""
    calls = []
    real = batch_search.convert
    monkeypatch.setattr(batch_search, "convert", lambda m, **kw: calls.append(kw["example_inputs"][0].shape[0])
                        or real(m, **kw))
    torch.manual_seed(0)
    net = _resnet()
    fit = convbn.max_batch(net, torch.randn(2, 3, 16, 16), "2MiB", method="measure")
    assert calls == [2] and len(fit.probes["convbn"]) > 3


def test_a_batch_whose_inputs_alone_are_over_is_never_made(monkeypatch):
    made = []
    real = batch_search.batch_of
    monkeypatch.setattr(batch_search, "batch_of", lambda s, b: made.append(b) or real(s, b))
    torch.manual_seed(0)
    fit = convbn.max_batch(_resnet(), torch.randn(2, 3, 16, 16), "2MiB", method="measure", upper=1 << 20)
    room = fit.usable - fit.resident
    assert all(b * 3 * 16 * 16 * 4 <= room for b in made)


def test_allocator_peak_counts_only_blocks_made_in_the_call():
    """The same step gives the same figure whether what it frees was made under an earlier
    profiler session or not (Note: [blocks from before the measurement])."""
    net, x = _mlp(), torch.randn(32, 64)

    def step():
        net.zero_grad(set_to_none=True)  # frees the gradients of the step before
        net(x).mean().backward()

    step()
    unprofiled = allocator_peak(step)  # the gradients freed were made without a profiler
    again = allocator_peak(step)  # these were made under the profiler of the call before
    assert unprofiled == again > sum(p.numel() * 4 for p in net.parameters())


@pytest.mark.parametrize("make", [lambda d: d.to_sparse(), lambda d: d.to_sparse_csr()], ids=["coo", "csr"])
def test_tensor_peak_counts_a_sparse_tensor_as_its_parts(make):
    dense = torch.zeros(64, 32)
    dense[::3, ::5] = 1.0
    with tensor_peak() as tp:
        s = make(dense)
    parts = (s._indices(), s._values()) if s.layout == torch.sparse_coo else (s.crow_indices(), s.col_indices(),
                                                                             s.values())
    assert tp.result.end == sum(p.untyped_storage().nbytes() for p in parts) > 0


def test_timeline_and_tensor_peak_count_a_sparse_gradient():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(1000, 16, sparse=True), nn.Linear(16, 4))
    idx = torch.randint(0, 1000, (8, 3))
    assert timeline(net, idx).peak > 0  # it raised: a sparse tensor has no storage
    net.zero_grad(set_to_none=True)
    with tensor_peak(net) as tp:
        net(idx).sum().backward()
    g = net[0].weight.grad
    assert g.layout == torch.sparse_coo
    kept = g._indices().untyped_storage().nbytes() + g._values().untyped_storage().nbytes()
    # the sparse gradient's parts counted (one int64 copy of the indices may still be alive), not a dense table
    assert kept + net[1].weight.grad.nbytes + net[1].bias.grad.nbytes <= tp.result.end < net[0].weight.nbytes


def test_confirm_seconds_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="CONFIRM_SECONDS is deprecated and no longer read"):
        assert largest_batch.CONFIRM_SECONDS == 20.0
    assert "CONFIRM_SECONDS" not in largest_batch.__all__
    with pytest.raises(AttributeError, match="no attribute 'CONFIRM_MINUTES'"):
        largest_batch.CONFIRM_MINUTES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert largest_batch.CONFIRM_FLOPS == batch_search.CONFIRM_FLOPS


def test_memtracker_internals_are_read_through_compat_only():
    """torch's MemTracker's private members are overridden and read in ``_compat.py`` alone."""
    import pathlib

    import convbn.memory as memory

    private = ("_curr_mem_snap", "_peak_mem", "_mod_tracker", "_known_modules", "_track_module_params_and_buffers",
               "_update_peak_stats", "_pre_fw_hook", "_param_to_grad_hook_handles", "_update_and_maybe_create_winfos",
               "_track_inputs_or_outputs", "_WINFO")
    for path in pathlib.Path(memory.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not [name for name in private if f".{name}" in text or f"def {name}" in text], path.name


class _GradAllocator:
    """An allocator that holds the gradients of ``net`` and nothing else: its counters read the
    gradients alive now, and its peak the most alive at any reading since the last reset."""

    def __init__(self, net):
        self.net, self.most = net, 0

    def allocated(self):
        now = sum(p.grad.untyped_storage().nbytes() for p in self.net.parameters() if p.grad is not None)
        self.most = max(self.most, now)
        return now

    def peak(self):
        self.allocated()
        return self.most

    def reset(self):
        self.most = self.allocated()

    def counters(self):
        return AllocatorCounters(self.allocated, self.peak, self.reset, lambda: None)


def test_an_allocator_meter_starts_after_the_previous_gradients_are_freed(monkeypatch):
    """The allocator meter (CUDA's) reads its start when the step begins, after ``zero_grad`` has
    freed the previous step's gradients, as the exact CPU meter does (Note: [an allocator meter
    starts where the step starts]). Read before, every later reading was low by the gradients'
    bytes: on an H200 a second timeline of the same net read 65536 for a 408064-byte step. Run on
    CPU with an allocator that holds only the gradients; fails with the start read when the
    meter is built."""
    net, x = _mlp(), torch.randn(32, 64)
    fake = _GradAllocator(net)
    monkeypatch.setattr(timelines, "_allocator_counters", lambda model, inputs: fake.counters())
    grads = sum(p.numel() * p.element_size() for p in net.parameters())
    first = timeline(net, x)  # no gradients before it
    again = timeline(net, x)  # the first step's gradients alive until this step's zero_grad
    stopped = timeline(net, x, stop_above=again.peak)
    assert first.source == again.source == "cuda"
    assert first.peak == again.peak == stopped.peak == grads
    assert min(p.bytes for p in again.points) == 0
    with pytest.raises(StepOverLimit):
        timeline(net, x, stop_above=grads - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_step_at_its_own_peak_is_not_stopped():
    """On CUDA the stop reads the bytes allocated now, not the allocator's peak since the last
    reading (which would count a freed block again and stop a step that fits), and every step
    is read from its own start, after the previous step's gradients are freed (Note: [an
    allocator meter starts where the step starts])."""
    net, x = _mlp().cuda(), torch.randn(32, 64, device="cuda")
    timeline(net, x)  # warm-up: cuBLAS's workspace and lazy initialisation, its gradients left alive
    net.zero_grad(set_to_none=True)
    clean = timeline(net, x)  # no gradients alive before it
    full = timeline(net, x)  # the previous step's gradients alive until its zero_grad
    assert full.peak == clean.peak >= sum(p.numel() * p.element_size() for p in net.parameters())
    assert min(p.bytes for p in full.points) >= 0
    assert timeline(net, x, stop_above=full.peak).peak == full.peak
    with pytest.raises(StepOverLimit) as err:
        timeline(net, x, stop_above=full.peak // 2)
    assert err.value.bytes > full.peak // 2


def _prediction_off(monkeypatch):
    """The convbn side's prediction made (a copy converted and stepped), then found off: the
    side is measured on a copy converted again."""
    real = batch_search.Search._fused_prediction

    def off(search):
        out = real(search)
        return out if isinstance(out, str) else " (the prediction was off)"

    monkeypatch.setattr(batch_search.Search, "_fused_prediction", off)


def test_a_copy_let_go_is_freed_before_the_next_is_made(monkeypatch):
    """When the convbn side's prediction is off, the copy converted for it (held in reference
    cycles) is freed before the copy the side is measured on is made and converted, not at some
    later collection (Note: [a copy let go is freed before the next is made]; the path of a
    ResNet-50 run that went 393.7 MiB over with a scratch reserve since reverted). Automatic collection is off: only max_batch's own
    frees count. Fails with the collection only where a copy is still held."""
    import copy
    import gc
    import types
    import weakref

    made, alive = [], []

    def recording(value, *args):
        alive.append(sum(r() is not None for r in made))
        out = copy.deepcopy(value, *args)
        made.append(weakref.ref(next(out[0].parameters())))  # a converted share-copy holds the copy's tensors
        return out

    monkeypatch.setattr(batch_search, "copy", types.SimpleNamespace(deepcopy=recording))
    _prediction_off(monkeypatch)
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    gc.collect()
    gc.disable()
    try:
        fit = convbn.max_batch(net, torch.randn(2, 3, 16, 16), "2MiB", optimizer=opt, confirm=True)
        assert len(made) == 3 and alive == [0, 0, 0]  # eager's copy, the predicted convbn one, the measured one
        assert all(r() is None for r in made)  # the last one freed before max_batch returned
    finally:
        gc.enable()
    assert "measured" in fit.how["convbn"] and "prediction was off" in fit.how["convbn"]


@pytest.mark.parametrize("method", ["predict", "measure", "predict, the prediction off"])
def test_answering_allocates_within_the_memory_where_kernels_need_no_scratch(method, monkeypatch):
    """Exact CPU allocator bytes over the whole call: on a channels-last net (oneDNN convolves
    it without reordering, so its kernels need no scratch beyond their outputs) the call peaks
    within ``memory`` (the copy, its optimizer state, the batch of inputs and the step) plus the
    stated constant of small allocations (1 KiB), also where the convbn side's
    prediction is off and it is measured on a copy converted again (automatic collection off).
    Fails with the stop before the operator removed (the crossing operator's output comes on
    top)."""
    import gc

    if method.endswith("off"):
        _prediction_off(monkeypatch)
        method = "predict"
    torch.manual_seed(0)
    net = _resnet().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = {}
    gc.collect()
    gc.disable()
    try:
        peak = allocator_peak(lambda: out.setdefault("fit", convbn.max_batch(net, x, "2MiB", optimizer=opt,
                                                                             method=method, confirm=True)))
    finally:
        gc.enable()
    fit = out["fit"]
    assert fit.convbn_batch + 1 in fit.probes["convbn"]  # the batch above was stepped (and stopped)
    assert peak <= fit.memory + batch_search.SMALL_ALLOCATIONS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_answering_allocates_within_the_memory():
    """On CUDA the allocator meters every step (workspaces included) and ``usable`` keeps 10 %
    of ``memory`` for the caching allocator: the allocator's peak over the whole call (the
    profiler's CUDA allocation events: ``max_memory_allocated`` around it would see only what
    followed the last timeline's reset), blocks made in the call only, stays within ``memory``
    (the batch of inputs in it). cuBLAS and cuDNN are initialised first by a plain step (their
    workspaces persist, as in a run)."""
    torch.manual_seed(0)
    net = _resnet().cuda()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    probe = _resnet().cuda()
    probe(x).mean().backward()
    del probe
    torch.cuda.synchronize()
    out = {}
    peak = allocator_peak(lambda: out.setdefault("fit", convbn.max_batch(net, x, "16MiB", optimizer=opt, confirm=True)),
                          device="cuda")
    fit = out["fit"]
    assert fit.convbn_batch >= fit.eager_batch > 2, str(fit)
    assert peak <= fit.memory, f"{peak} bytes allocated in the call, memory {fit.memory}: {fit}"


def test_a_stopped_step_is_let_go_at_once(monkeypatch):
    """The batch a stopped step trained on (and the step's tensors) are freed when the step
    returns, not at the next garbage collection: the exception is kept without its traceback,
    which held the step's frames in a reference cycle beside the next step."""
    import gc
    import weakref

    made = []
    real = batch_search.batch_of

    def recorded(sample, b):
        out = real(sample, b)
        made.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(batch_search, "batch_of", recorded)
    torch.manual_seed(0)
    search = batch_search.Search(_resnet(), None, (torch.randn(2, 3, 16, 16),), None, 600_000, 1 << 10,
                                 torch.device("cpu"), True, {})
    m, o = search.held
    gc.disable()
    try:
        made.clear()
        out = search.step(m, o, 64)
        assert isinstance(out, StepOverLimit) and out.__traceback__ is None
        assert made and all(r() is None for r in made)
    finally:
        gc.enable()



_FIRST_STEP_IN_A_FRESH_PROCESS = """
import gc, sys, weakref
import torch
from torch import nn
import convbn.batch_search as batch_search
from convbn.memory.timelines import StepOverLimit
assert "torch._dynamo" not in sys.modules, "the check needs a process where nothing imported Dynamo yet"
made = []
real = batch_search.batch_of
def recorded(sample, b):
    out = real(sample, b)
    made.append(weakref.ref(out[0]))
    return out
batch_search.batch_of = recorded
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                    nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
search = batch_search.Search(net, None, (torch.randn(2, 3, 16, 16),), None, 300_000, 1 << 10,
                             torch.device("cpu"), True, {})
m, o = search.held
gc.disable()
made.clear()
out = search.step(m, o, 64)
assert isinstance(out, StepOverLimit), out
print("freed" if made and all(r() is None for r in made) else "alive")
"""


def test_the_first_stopped_step_of_a_fresh_process_is_let_go_at_once():
    """The same in a process where nothing imported Dynamo before max_batch: the exact meter's
    first use imports it, and an import inside a step left the step's frames (and its batch) in a
    reference cycle until the next garbage collection; the search loads it before its first step."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _FIRST_STEP_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "freed", done.stdout


class _Down(nn.Module):
    """A residual block that halves the resolution: a stride-2 3x3 branch and a stride-2
    pointwise shortcut, both from the block's input (ResNet's downsampling block)."""

    def __init__(self, width):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width)
        self.conv2, self.bn2 = nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width)
        self.down, self.bn3 = nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width)

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + self.bn3(self.down(x)))


def _left_allocated(fn):
    """Bytes the CPU allocator allocated within ``fn`` and still holds after it."""
    from torch.profiler import ProfilerActivity, profile

    from convbn.memory.peaks import _allocations

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    blocks = {}
    for _, ptr, nbytes in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree(),
                                              torch.device("cpu"))):
        if nbytes > 0:
            blocks[ptr] = nbytes
        else:
            blocks.pop(ptr, None)
    return sum(blocks.values())


def test_a_step_stopped_in_backward_leaves_nothing_allocated():
    """A converted model's step stopped in a chain's backward (as max_batch's probes are) holds
    nothing once the stop is caught: the autograd engine's pending nodes and the tensors they
    saved are let go at once, not at the next backward (Note: [a backward stopped part way is
    let go]). Fails without the drain (the branch of the downsampling block not yet run keeps
    its saved tensors)."""
    import gc

    from convbn.passes.plan.plan_inputs import measure_peak

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), _Down(8),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    x = torch.randn(8, 3, 16, 16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    conv = convbn.convert(net, example_inputs=x, strategy="recompute_conv")
    full = measure_peak(conv, (x,), optimizer=opt)
    left, phases = {}, set()
    backward = [(i, p) for i, p in enumerate(full.points) if p.phase == "backward"]
    for i, p in backward[::8]:  # stopped at every 8th backward operator (in both of the block's branches)

        def stopped():
            try:
                measure_peak(conv, (x,), optimizer=opt, stop_above=p.bytes - 1)
            except StepOverLimit as over:
                phases.add(over.point.phase)
            gc.collect()

        left[i] = _left_allocated(stopped)
    assert "backward" in phases and not any(left.values()), left
