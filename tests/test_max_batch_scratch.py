"""max_batch counts its steps' kernel scratch (Note: [kernel scratch] in
``src/convbn/memory/kernel_scratch.py``; Note: [the kernels' scratch in the convbn prediction] in
``src/convbn/batch_search.py``): each convolution's scratch recorded as the table's row says,
computed here by hand, and the whole call within ``memory`` by the CPU allocator's exact bytes on
a net with strided convolutions, where the same call without the scratch goes over.
"""
import torch
import torch.nn as nn

import convbn
import convbn.batch_predict as batch_predict
import convbn.batch_search as batch_search
import convbn.memory.timelines as timelines
from convbn.batch_search import SMALL_ALLOCATIONS, batch_of
from convbn.memory import allocator_peak, timeline
from convbn.memory.kernel_scratch import ConvCall, NormCall, scratch_bytes

K = 64 * 1024


def _strided_net():
    """A 3-channel stem with stride 2, a stride-2 and a stride-1 convolution, each with BatchNorm;
    an eager step's peak with the scratch is the stride-1 convolution's backward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _by_hand(n):
    """Each convolution's scratch at batch ``n`` (32² images), from the table's rows by hand, in
    the order the step runs them: forwards, then backwards from the last layer.
    Bytes: x, y blocked (16 channels at least), w plain; the stem's input plain (3 channels, no gradient)."""
    x0, y0, w0 = n * 3 * 32 * 32 * 4, n * 16 * 16 * 16 * 4, 16 * 3 * 9 * 4  # the stem, stride 2
    x1, y1, w1 = n * 16 * 16 * 16 * 4, n * 64 * 8 * 8 * 4, 64 * 16 * 9 * 4  # stride 2
    x2, y2, w2 = n * 64 * 8 * 8 * 4, n * 32 * 8 * 8 * 4, 32 * 64 * 9 * 4  # stride 1
    forward = [max(x0 + w0, y0) + x0 // 8 + K, max(x1 + w1, y1) + x1 // 8 + K, max(x2 + w2, y2) + K]
    backward = [x2 + y2 + 2 * w2 + K,  # stride 1
                2 * x1 + y1 + 2 * w1 + K,  # stride 2, the input's gradient asked: an input-sized buffer beside it
                x0 + y0 + 2 * w0 + K]  # the stem: weight only, its input plain
    return forward + backward


def test_each_convolutions_scratch_is_recorded_as_the_row_says():
    net = _strided_net()
    for n in (17, 4):  # 17: the row chosen again at a batch above 16 too
        tl = timeline(net, torch.randn(n, 3, 32, 32), kernel_scratch=True)
        convs = [p for p in tl.points if isinstance(p.call, ConvCall)]
        assert [p.scratch for p in convs] == _by_hand(n)
        assert [p.call.backward for p in convs] == [False] * 3 + [True] * 3
        norms = [p.scratch for p in tl.points if isinstance(p.call, NormCall)]  # their inputs' bytes
        assert norms == [n * 32 * 8 * 8 * 4, n * 64 * 8 * 8 * 4, n * 16 * 16 * 16 * 4]
        assert tl.process_peak == max(p.bytes + p.scratch for p in tl.points) > tl.peak
        assert all(p.scratch == 0 for p in tl.points if p.call is None)
    assert timeline(net, torch.randn(4, 3, 32, 32)).process_peak == tl.peak  # off by default: live tensors only


def test_the_scratch_is_the_cpus_only():
    call = ConvCall(True, "cuda", (4, 16, 16, 16), (16, 16, 3, 3), (4, 16, 16, 16), torch.float32, False,
                    (2, 2), (1, 1), (1, 1), (0, 0), 1, False, (True, True, False))
    assert scratch_bytes(call) == 0  # the CUDA allocator meter counts workspaces itself
    assert scratch_bytes(ConvCall(**{**call.__dict__, "device": "cpu"})) > 0


def test_the_eager_answer_is_the_largest_batch_whose_step_and_scratch_fit():
    """The eager side's predicted answer against steps at every batch, each convolution's
    scratch (``_by_hand``) and each BatchNorm backward's (its input's bytes) added by hand to the
    live bytes its point recorded."""
    net = _strided_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 32, 32)
    fit = convbn.max_batch(net, x, "6MiB", optimizer=opt, confirm=False)
    search = batch_search.Search(net, opt, (x,), None, fit.memory, 1 << 16, torch.device("cpu"), False, {})
    m, o = search.fresh()

    def total(n):
        tl = timeline(m, *batch_of((x,), n), optimizer=o, kernel_scratch=True)
        scratch = iter(_by_hand(n) + [n * 32 * 8 * 8 * 4, n * 64 * 8 * 8 * 4, n * 16 * 16 * 16 * 4])
        convs = [p for p in tl.points if isinstance(p.call, ConvCall)]
        convs += [p for p in tl.points if isinstance(p.call, NormCall)]
        by_hand = {id(p): next(scratch) for p in convs}
        return search.before(n) + max(p.bytes + by_hand.get(id(p), 0) for p in tl.points)

    answer = next(n for n in range(2, 200) if total(n + 1) > fit.usable)
    assert fit.eager_batch == answer > 4 and fit.how["eager"].startswith("predicted")
    assert fit.eager_peak == total(answer) - search.before(answer)


def _answer_and_peak(monkeypatch=None):
    net = _strided_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    fits = []
    peak = allocator_peak(lambda: fits.append(convbn.max_batch(net, torch.randn(2, 3, 32, 32), "6MiB", optimizer=opt,
                                                                confirm=True)))
    return fits[0], peak


def test_the_call_stays_within_the_memory_by_the_cpu_allocator(monkeypatch):
    """Exact CPU allocator bytes over the whole call (predict, confirmed): within ``memory`` plus
    SMALL_ALLOCATIONS; with the scratch taken as 0 (the code before it was counted) the same call
    answers larger batches and goes over."""
    fit, peak = _answer_and_peak()
    assert peak <= fit.memory + SMALL_ALLOCATIONS
    for module in (timelines, batch_predict, batch_search):
        monkeypatch.setattr(module, "scratch_bytes", lambda call: 0)
    blind, blind_peak = _answer_and_peak()
    assert blind.eager_batch > fit.eager_batch and blind.convbn_batch > fit.convbn_batch
    assert blind_peak > blind.memory + 100 * 1024
