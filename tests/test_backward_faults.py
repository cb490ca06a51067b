"""A backward that fails part way, then retried: eager's error or eager's gradients, never a crash.

A fused chain frees what it kept as soon as each layer is done with it and accumulates its
weight gradients into ``.grad`` as it goes. When the backward stops part way (an exception
inside, Ctrl-C, a failing op in another node) and the user calls ``backward`` again, eager
raises "Trying to backward through the graph a second time" where the nodes that had run
were released, and otherwise computes the gradients again. Each scenario runs the eager
model and its converted twin through the same fault and retry, in a fresh interpreter (so a
segmentation fault fails the test, not the run), and compares: the retry's exception type
and message, and every parameter's final ``.grad``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import convbn

_SCRIPT = textwrap.dedent(
    r'''
    import json, sys
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    import convbn

    SCENARIO, FAULT, AT, RETAIN = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    torch.set_num_threads(1)

    def fault():
        return KeyboardInterrupt() if FAULT == "KeyboardInterrupt" else RuntimeError("injected fault")

    class FailOnConvBackward(TorchDispatchMode):
        """Raises at the AT-th convolution backward: a failing allocation inside a backward."""

        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                self.seen += 1
                if self.seen == AT:
                    raise fault()
            return func(*args, **(kwargs or {}))

    class FailOnce(torch.autograd.Function):
        calls = None  # armed by run(): convert's own checks run backwards too

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if FailOnce.calls is None:
                return g
            FailOnce.calls += 1
            if FailOnce.calls == 1:
                raise fault()
            return g

    class Between(nn.Module):
        def forward(self, x):
            return FailOnce.apply(x)

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    def build():
        torch.manual_seed(0)
        mid = [Between()] if SCENARIO == "between_chains" else []
        return nn.Sequential(*block(3, 8), *mid, *block(8, 8), *block(8, 8))

    def describe(exc):
        return None if exc is None else [type(exc).__name__, str(exc).split(".")[0]]

    def run(model, x):
        FailOnce.calls = 0
        out = model(x)
        if SCENARIO == "hook_on_output":
            calls = []

            def hook(g):
                calls.append(1)
                if len(calls) == 1:
                    raise fault()
            out.register_hook(hook)
        loss = out.sum()
        first = retry = None
        try:
            if SCENARIO == "inside":
                with FailOnConvBackward():
                    loss.backward(retain_graph=RETAIN)
            else:
                loss.backward(retain_graph=RETAIN)
        except BaseException as e:
            first = e
        saved_read = "ok"
        node_list, seen = [loss.grad_fn], set()
        while node_list:  # every node's saved tensors: readable, or an error; never a crash
            node = node_list.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            try:
                for t in getattr(node, "saved_tensors", ()):
                    if isinstance(t, torch.Tensor):
                        float(t.double().sum())
            except RuntimeError:
                saved_read = "raised"
            node_list.extend(n for n, _ in node.next_functions)
        try:
            loss.backward()
        except BaseException as e:
            retry = e
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        FailOnce.calls = None
        return describe(first), describe(retry), grads, len(seen), saved_read

    x = torch.randn(4, 3, 8, 8)
    eager = build()
    fused = convbn.convert(build(), strategy="recompute_bn", example_inputs=(x,))
    e_first, e_retry, e_grads, _, _ = run(eager, x)
    f_first, f_retry, f_grads, _, saved_read = run(fused, x)
    out = fused(x)
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    mismatch = []
    for name, g in e_grads.items():
        h = f_grads[name]
        if (g is None) != (h is None):
            mismatch.append(f"{name}: eager {'None' if g is None else 'set'}, fused {'None' if h is None else 'set'}")
        elif g is not None and not torch.allclose(g, h, rtol=1e-4, atol=1e-4 * (1 + float(g.abs().max()))):
            mismatch.append(f"{name}: max diff {float((g - h).abs().max()):.3g}")
    print(json.dumps({
        "eager": [e_first, e_retry], "fused": [f_first, f_retry], "mismatch": mismatch,
        "grads_set": sum(g is not None for g in e_grads.values()), "saved_read": saved_read,
        "chains_ran": names.count("ChainFunctionBackward"), "fused_layers": len(fused.convbn_report.pairs),
    }))
    '''
)


def _run(*argv: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(convbn.__file__)))  # this checkout's src/
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *argv], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, (f"the scenario {argv} ended with exit status {proc.returncode} "
                                  f"(-11: segmentation fault)\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario, fault, at, retain, retry_raises", [
    # inside a chain's backward: after it freed kept tensors and accumulated some weight gradients
    ("inside", "RuntimeError", 2, False, True),
    ("inside", "KeyboardInterrupt", 1, False, True),
    ("inside", "KeyboardInterrupt", 2, False, True),
    # a retained graph frees nothing: the retry computes (and accumulates) again, as eager's does
    ("inside", "RuntimeError", 2, True, False),
    # a node between two chains fails: the chain after it had run and was released
    ("between_chains", "RuntimeError", 0, False, True),
    ("between_chains", "KeyboardInterrupt", 0, False, True),
    # a hook on the output fails before any chain ran: the retry computes everything
    ("hook_on_output", "RuntimeError", 0, False, False),
])
def test_retry_after_a_failed_backward_is_eager(scenario: str, fault: str, at: int, retain: bool,
                                                retry_raises: bool) -> None:
    got = _run(scenario, fault, str(at), "1" if retain else "0")
    assert got["fused_layers"] == 3 and got["chains_ran"] >= 1, got
    e_first, e_retry = got["eager"]
    f_first, f_retry = got["fused"]
    assert e_first is not None and e_first[0] == fault, got  # the fault happened in eager
    assert f_first == e_first, got
    if retry_raises:
        assert e_retry is not None and e_retry[0] == "RuntimeError", got
        assert e_retry[1].startswith("Trying to backward through the graph a second time"), got
        assert f_retry is not None and f_retry[0] == e_retry[0] and f_retry[1] == e_retry[1], got
    else:
        assert e_retry is None and f_retry is None, got
    assert got["grads_set"] > 0, got
    assert not got["mismatch"], got  # .grad as eager leaves it: nothing accumulated twice
