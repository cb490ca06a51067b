"""What the planner records and decides on a set of models, pickled, to compare two source trees.

For each model: ``convert(model, example_inputs=x)``'s plans (every chain's layer modes and
may-drop flags), what ``plan_auto`` measured (eager saved bytes and peak, floor, the planner's
inputs), one ``record_eager_and_chains`` at the example batch and the public ``timeline`` of the
eager and the converted model. Run it on each tree, then ``--compare``:

    PYTHONPATH=<tree A>/src:tests python benchmarks/plan_snapshot.py /tmp/a.pkl [models...]
    PYTHONPATH=<tree B>/src:tests python benchmarks/plan_snapshot.py /tmp/b.pkl [models...]
    python benchmarks/plan_snapshot.py --compare /tmp/a.pkl /tmp/b.pkl

``pub`` (the public timelines) differs between two processes even on one tree: the module a
backward point is attributed to is chosen among equals by set order (string hashing); the
comparison also says whether they agree but for those names.
"""
import os
import pickle
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import convbn
from convbn.passes.plan import auto_plan as ap
from convbn.passes.plan.plan_inputs import chains_of
from convbn.passes.plan.sliced_measure import record_eager_and_chains
from convbn.passes.graph.graph_module import eager
from convbn.passes.graph.share_copy import share_copy
from convbn.memory import timeline
from zoo import import_torchvision_without_fake_kernels
from robust_models import MODELS
from densenet_models import make_densenet_bc
tv = import_torchvision_without_fake_kernels()
def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
def gn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv2d(8, 4, 1))
cases = {
    "net": (net, (8, 3, 16, 16)), "gn": (gn, (8, 3, 16, 16)),
    "r18": (tv.models.resnet18, (8, 3, 64, 64)), "r50": (tv.models.resnet50, (8, 3, 64, 64)),
    "mnv3": (tv.models.mobilenet_v3_small, (8, 3, 64, 64)),
    "r18_224": (tv.models.resnet18, (16, 3, 224, 224)), "r50_224": (tv.models.resnet50, (8, 3, 224, 224)),
    "densenet": (make_densenet_bc, (8, 3, 32, 32)),
}
for k, (f, inp) in MODELS.items():
    cases[k] = (f, inp)


def compare(a_path: str, b_path: str) -> None:
    a, b = (pickle.load(open(p, "rb")) for p in (a_path, b_path))
    strip = lambda pub: [[(q[0], q[1], q[2] if q[1] != "backward" else "", q[3]) for q in t] for t in pub]  # noqa: E731
    for k in a:
        if k in b:
            same = {f: a[k][f] == b[k][f] for f in a[k]}
            print(k, same, "pub but backward names:", strip(a[k]["pub"]) == strip(b[k]["pub"]))


if sys.argv[1] == "--compare":
    compare(sys.argv[2], sys.argv[3])
    sys.exit(0)
only = sys.argv[2:] or [k for k in cases if not k.endswith("_224")]
out = {}
for name in only:
    make, shape = cases[name]
    torch.manual_seed(0)
    x = torch.randn(shape) if isinstance(shape, tuple) else shape()
    m = make()
    got = []
    real = ap._measure
    ap._measure = lambda *a, **k: got.append(real(*a, **k)) or got[-1]
    try:
        fast = convbn.convert(m, example_inputs=x, progress=False)
    finally:
        ap._measure = real
    rep = fast.convbn_report if hasattr(fast, "convbn_report") else None
    plans = [(tuple(l.mode for l in c.layers), tuple(c.plan.may_drop)) for c in chains_of(fast)]
    meas = [(g.eager, g.eager_peak, g.floor, g.inputs) for g in got]
    with eager(fast):
        reference = share_copy(fast)
    rec = record_eager_and_chains(reference, fast, (x,))
    pub = [tuple((p.bytes, p.phase, p.module, p.op) for p in timeline(mm, x).points) for mm in (reference, fast)]
    rec_numbers = (rec.eager_saved, rec.eager_peak, rec.eager_points, rec.eager_ops, rec.inputs)
    out[name] = dict(plans=plans, meas=meas, rec=rec_numbers, pub=pub)
    print(name, len(plans), meas[0][:3] if meas else None, flush=True)
pickle.dump(out, open(sys.argv[1], "wb"))
