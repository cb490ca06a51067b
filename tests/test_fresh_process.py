"""A converted model outlives its process: saved whole (``torch.save``), pickled, deep-copied
or reduced to its ``state_dict``, then used in a *fresh* interpreter -- trained eagerly and
under ``torch.compile(fullgraph=True)`` -- it computes what the eager model computes
(issue 23). Nothing it needs may live only in the process that converted it (Note: [the
chain's structure travels with it] in nn/chain.py).

One child interpreter does all of it, on files the parent wrote:

* ``torch.load`` / ``pickle.load`` of the converted model, and a ``copy.deepcopy`` of the
  loaded one: a training step equal to eager's, then the same under ``torch.compile``;
* the converted model's ``state_dict`` loaded into an *unconverted* model (the child's eager
  reference), which the child converts and trains, saving its ``state_dict``; the parent
  loads that back into its converted model and continues equal to eager.
"""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import torch
from torch import nn
from torch.testing import assert_close

import convbn
from fusion_checks import assert_chain_ran, assert_fused

TESTS = os.path.dirname(os.path.abspath(__file__))
#: the convbn this process imported: the child imports the same
SRC = os.path.dirname(os.path.dirname(os.path.abspath(convbn.__file__)))


def _net() -> nn.Sequential:
    """Two chains (a max pool between them, kept lean) with a PReLU tail, in float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.PReLU(6),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
    ).double()


CHILD = textwrap.dedent(r"""
    import copy, pickle, sys
    import torch
    from torch import nn
    from torch.testing import assert_close
    import convbn
    from convbn.nn.chain import FusedChain
    from fusion_checks import assert_chain_ran, fused_chains

    d = sys.argv[1]
    torch.set_num_threads(1)
    x = torch.load(d + "/x.pt")

    def eager_model():
        # the unconverted architecture, with the converted model's state (converted -> unconverted)
        m = torch.load(d + "/arch.pt", weights_only=False)
        m.load_state_dict(torch.load(d + "/state.pt"))
        return m

    def step(model, compiled=False):
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return out.detach(), xi.grad, grads, [b.clone() for b in model.buffers()]

    def same(a, b, what):
        for u, v in zip(a[2:], b[2:]):
            assert len(u) == len(v), what
        for i, (u, v) in enumerate(zip(a, b)):
            assert_close(u, v, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}, item {i}: {m}")

    loaded = {
        "torch.save": torch.load(d + "/converted.pt", weights_only=False),
        "pickle": pickle.load(open(d + "/converted.pkl", "rb")),
    }
    loaded["deepcopy"] = copy.deepcopy(loaded["torch.save"])
    for how, conv in loaded.items():
        chains = fused_chains(conv)  # registered or added by the in-place rewrite
        assert len(chains) == 2, (how, len(chains))
        ref = eager_model()
        same(step(conv), step(ref), f"{how}: training step")
        # the fused Function ran (not an eager fallback)
        out = conv(x.clone().requires_grad_())
        assert_chain_ran(out, calls=2)
        ref(x)
        same(step(conv, compiled=True), step(ref), f"{how}: compiled training step")

    # unconverted -> converted in this process, trained, its state_dict handed back
    eager = eager_model()
    conv = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    assert len(conv.convbn_report.pairs) == 3, str(conv.convbn_report)
    same(step(conv), step(eager), "converted here: training step")
    torch.save(conv.state_dict(), d + "/back.pt")
    torch.save(eager.state_dict(), d + "/back_eager.pt")
    print("fresh process: ok")
""")


def test_saved_pickled_copied_models_train_and_compile_in_a_fresh_process(tmp_path) -> None:
    eager = _net()
    conv = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    assert_fused(conv, pairs=3, chains=2, strategies={"recompute_conv"})
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for m in (eager, conv):  # state that differs from a fresh model's: running stats, num_batches_tracked
        m(x).sum().backward()
    assert_chain_ran(conv(x.requires_grad_()), calls=2)
    x = x.detach()
    torch.save(conv, tmp_path / "converted.pt")
    with open(tmp_path / "converted.pkl", "wb") as f:
        pickle.dump(conv, f)
    torch.save(conv.state_dict(), tmp_path / "state.pt")
    torch.save(_net(), tmp_path / "arch.pt")  # the unconverted architecture (other values)
    torch.save(x, tmp_path / "x.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, TESTS,
                                                         os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"the fresh process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "fresh process: ok" in proc.stdout
    # and back: the child's trained state into this process's converted model and its eager twin
    conv.load_state_dict(torch.load(tmp_path / "back.pt"))
    eager.load_state_dict(torch.load(tmp_path / "back_eager.pt"))
    for m in (conv, eager):
        m.zero_grad(set_to_none=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = eager(xe), conv(xc)
    assert_chain_ran(out_c, calls=2)
    out_e.square().mean().backward()
    out_c.square().mean().backward()
    assert_close(out_c, out_e, rtol=1e-9, atol=1e-9)
    assert_close(xc.grad, xe.grad, rtol=1e-9, atol=1e-9)
    for (n, pc), pe in zip(conv.named_parameters(), eager.parameters()):
        assert_close(pc.grad, pe.grad, rtol=1e-9, atol=1e-9, msg=n)
    for bc, be in zip(conv.buffers(), eager.buffers()):
        assert_close(bc, be, rtol=1e-9, atol=1e-9)
