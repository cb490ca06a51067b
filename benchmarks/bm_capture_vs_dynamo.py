"""convbn's own capture side by side with Dynamo's (``torch.compile``'s front end).

Three parts, each a printed table and a JSON file under ``benchmarks/results/``:

* ``cases``: every case of the capture issue (shape-dependent padding, inline drop-path,
  ``torch.no_grad()`` inside forward, an optional argument at its default, ``requires_grad``
  set on a view of the input, a first output without grad, ``torch.utils.checkpoint``,
  Python attributes changed after capture, submodules replaced after capture), float64, CPU.
  Each runs eager and three captures of twins of it: ``convbn.convert`` without and with
  ``example_inputs``, and ``torch.compile`` with :class:`dynamo_probe.Probe` (Dynamo only:
  the captured graphs run as they are). Three training steps (the change, if any, between
  the first and the second), each compared with eager: outputs, every gradient (``None``
  where eager has ``None``), running statistics and ``num_batches_tracked``. Recorded:
  equal (yes / no, the largest error), convbn's report (BatchNorms fused, fused chain calls
  in the last output's autograd graph, re-captures, variants, fallbacks) and Dynamo's
  (graphs, graph breaks and their reasons, graphs compiled after the first step, the batch
  norms its graphs hold and how: inlined ``F.batch_norm`` with lifted parameters, or module
  calls, and the Conv -> BN pairs a fusion backend could match).
* ``resnet50``: torchvision ResNet-50, batch 8, 224 x 224, float32, CPU. First call: seconds
  for ``convert`` (without / with ``example_inputs``) plus the first training step, against
  the first compiled step (``backend="eager"``); later steps in interleaved rounds (eager,
  convbn, Dynamo in turn, medians, ratio to eager); the per-call guard check alone: convbn's
  ``Guards.changed()`` over every installed forward, Dynamo's guard manager ``check`` on the
  frame's locals (microseconds, median of repetitions).
* ``sweep``: models from ``bm_sweep.py``'s families that build here (Hugging Face, kornia,
  Ultralytics) and torchvision, float32, batch 2, one thread, a subprocess each: BatchNorms
  called in eager training; convbn without ``example_inputs`` (second step): fused and
  running, equal to eager; Dynamo: graphs, graph breaks, batch norms in its graphs, Conv ->
  BN pairs, equal to eager.

Run (the machine's load varies: compare ratios from one run)::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bm_capture_vs_dynamo.py cases
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bm_capture_vs_dynamo.py resnet50 [--rounds 5]
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bm_capture_vs_dynamo.py sweep [--models hf:ResNet tv:resnet18]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import convbn  # noqa: E402
from capture_cases import CASES, Case, case_models  # noqa: E402
from dynamo_probe import Probe, dynamo_counters, reset  # noqa: E402

__all__ = ["CASES", "run_case", "run_resnet50", "run_sweep_model", "main"]

RESULTS = os.path.join(HERE, "results")
TOL = 1e-9  # float64, the tolerance of the capture tests

# --------------------------------------------------------------------------- (a) the cases

def _rand(shape: Tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _train_step(model: nn.Module, state: nn.Module, x: torch.Tensor, kw: Dict[str, Any], seed: int,
                x_grad: bool) -> Dict[str, Any]:
    """One seeded step; outputs, input gradient, every parameter gradient and buffer of ``state``."""
    state.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(x_grad)
    torch.manual_seed(seed)
    out = model(x, **kw)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    trained = [t for t in leaves if t.requires_grad]
    if trained:
        loss = sum((t * _rand(t.shape, 100 + seed + i)).sum() for i, t in enumerate(trained))
        loss.backward()
    return {"out": [t.detach().clone() for t in leaves], "x_grad": x.grad, "last": trained[-1] if trained else None,
            "grads": {n: p.grad for n, p in state.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in state.named_buffers()}}


def _diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _compare(ref: Dict[str, Any], got: Dict[str, Any]) -> float:
    errs = [_diff(a, b) for a, b in zip(got["out"], ref["out"])] + [_diff(got["x_grad"], ref["x_grad"])]
    errs += [_diff(got["grads"].get(n), g) for n, g in ref["grads"].items()]
    errs += [_diff(got["buffers"].get(n), b) for n, b in ref["buffers"].items()]
    if len(got["out"]) != len(ref["out"]) or got["grads"].keys() != ref["grads"].keys():
        errs.append(float("inf"))
    return max(errs)


def _chain_calls(out: Optional[torch.Tensor]) -> int:
    from fusion_checks import chain_nodes

    return len(chain_nodes(out)) if out is not None else 0


def _twins(make: Callable[[], nn.Module]) -> Tuple[nn.Module, nn.Module]:
    from capture_helpers import twins

    return twins(make)


SYSTEMS = ("convbn", "convbn-ei", "dynamo", "dynamo-aot")


def _capture(system: str, twin: nn.Module, x: torch.Tensor, probe: Probe) -> nn.Module:
    """``twin`` captured by ``system``: convbn without / with ``example_inputs``, Dynamo with the
    probe (graphs run as captured), Dynamo + AOTAutograd (the probe, then ``aot_eager``)."""
    if system == "dynamo":
        return torch.compile(twin, backend=probe)
    if system == "dynamo-aot":
        from torch._dynamo.backends.debugging import aot_eager

        return torch.compile(twin, backend=lambda gm, ex: (probe(gm, ex), aot_eager(gm, ex))[1])
    return convbn.convert(twin, example_inputs=x if system == "convbn-ei" else None)


def _raised(where: str, exc: BaseException) -> str:
    return f"{where} raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _steps(case: Case, eager: nn.Module, model: nn.Module, state: nn.Module,
           probe: Probe) -> Dict[str, Any]:  # three steps, the change between the first two
    """Three steps of eager and of the captured ``model`` (gradients and buffers read off
    ``state``); the largest difference, or where it raised; the graphs compiled after step 1."""
    after = dict(case.after)
    shape_after = after.pop("shape", case.shape)
    rec: Dict[str, Any] = {"max_err": 0.0}
    for s in range(3):
        if s == 1 and case.change is not None:
            (case.eager_change or case.change)(eager)
            case.change(state)
        xs = _rand(case.shape if s == 0 else shape_after, 1 + s)
        kw = after if s else {}
        try:
            ref = _train_step(eager, eager, xs, kw, s, case.x_grad)
        except Exception as exc:  # noqa: BLE001 - eager itself raises: nothing to compare
            return {**rec, "equal": None, "error": _raised(f"eager step {s}", exc)}
        try:
            got = _train_step(model, state, xs, kw, s, case.x_grad)
        except Exception as exc:  # noqa: BLE001 - recorded: the captured model raised where eager trains
            return {**rec, "equal": False, "error": _raised(f"step {s}", exc)}
        rec["max_err"] = max(rec["max_err"], _compare(ref, got))
        rec["last"] = got["last"]
        if s == 0:
            rec["graphs_step1"] = len(probe.graphs)
    rec["equal"] = rec["max_err"] <= TOL
    return rec


def run_case(name: str, system: str) -> Dict[str, Any]:
    """Three training steps of ``system`` (one of :data:`SYSTEMS`) against eager on the case
    ``name``; a JSON-able record."""
    case = case_models()[name]
    reset()
    probe = Probe()
    eager, twin = _twins(case.make)
    rec: Dict[str, Any] = {"case": name, "system": system}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = _capture(system, twin, _rand(case.shape, 1), probe)
        except Exception as exc:  # noqa: BLE001 - recorded: the capture raised where eager trains
            return {**rec, "equal": False, "error": _raised("capture", exc)}
        state = model if system.startswith("convbn") else twin  # convert returns a copy on the same tensors
        rec.update(_steps(case, eager, model, state, probe))
    last = rec.pop("last", None)
    rec["messages"] = [str(w.message).splitlines()[0][:200] for w in caught
                       if issubclass(w.category, (UserWarning, RuntimeWarning))][:4]
    if system.startswith("dynamo"):
        rec.update(probe.summary(), **dynamo_counters())
        rec["graphs_after_step1"] = len(probe.graphs) - rec.get("graphs_step1", len(probe.graphs))
    else:
        report = model.convbn_report
        outcomes = report.outcomes
        rec.update(fused=sum(o.result == "fused" for o in outcomes), bns=len(outcomes),
                   fallback=sum(o.reason.startswith("fallback") for o in outcomes if o.result == "left"),
                   recaptures=len(report.changes), variants=len(report.variants), chain_calls=_chain_calls(last))
    return rec


def _yes(rec: Dict[str, Any]) -> str:
    if rec.get("equal") is None and "error" in rec:
        return "(eager raises)"
    if "error" in rec:
        return "no: " + rec["error"][:70]
    return "yes" if rec["equal"] else f"no ({rec['max_err']:.2g})"


def cases_table(records: List[Dict[str, Any]]) -> str:
    """The markdown table of the ``cases`` part."""
    by = {(r["case"], r["system"]): r for r in records}
    lines = ["| case | convbn: = eager; fused of BNs; chain calls in the output; re-captures, variants, fallbacks "
             "| convbn `example_inputs`: same | Dynamo (graphs run as captured): = eager; graphs, breaks; "
             "compiled after step 1; BNs in graphs (inlined, lifted); Conv->BN pairs | Dynamo + AOTAutograd: "
             "= eager |", "|---|---|---|---|---|"]
    for case in CASES:
        cells = []
        for system in ("convbn", "convbn-ei"):
            r = by[(case, system)]
            cells.append(_yes(r) if "fused" not in r else
                         f"{_yes(r)}; {r['fused']} of {r['bns']}; {r['chain_calls']}; "
                         f"{r['recaptures']}, {r['variants']}, {r['fallback']}")
        d = by[(case, "dynamo")]
        cells.append(f"{_yes(d)}; {d.get('graphs', 0)}, {d.get('graph_breaks', 0)}; {d.get('graphs_after_step1', 0)}"
                     f"; {d.get('bn_function', 0) + d.get('bn_module', 0)} ({d.get('bn_function', 0)}, "
                     f"{d.get('bn_lifted', 0)}); {d.get('pairs', 0)}")
        cells.append(_yes(by[(case, "dynamo-aot")]))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_cases() -> List[Dict[str, Any]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # SyncBatchNorm's case
    try:
        return [run_case(c, s) for c in CASES for s in SYSTEMS]
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- (b) ResNet-50

def _step_time(model: nn.Module, x: torch.Tensor) -> float:
    t = time.perf_counter()
    model(x).mean().backward()
    return time.perf_counter() - t


def _median_us(fn: Callable[[], Any], reps: int = 500, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(times)


def _convbn_guard_us(fast: nn.Module) -> Tuple[float, int]:
    """Microseconds for every installed forward's ``Guards.changed()``, and modules guarded."""
    from convbn.passes.graph.graph_module import installed

    guards = [f.guards for f in map(installed, fast.modules()) if f is not None and getattr(f, "guards", None)]

    def check() -> None:
        for g in guards:
            if g.changed() is not None:
                raise RuntimeError(f"a guard failed on an unchanged model: {g.changed()}")
    return _median_us(check), sum(len(g) for g in guards)


def _dynamo_guard_us(captured: List[Tuple[Any, Dict[str, Any]]]) -> Tuple[float, int]:
    """Microseconds for the guard manager's ``check`` of every compiled frame on its own locals."""
    managers = [(gm.root if hasattr(gm, "root") else gm, scope) for gm, scope in captured]
    for root, scope in managers:
        if not root.check(scope):
            raise RuntimeError("Dynamo's guards fail on the locals they were built from")

    def check() -> None:
        for root, scope in managers:
            root.check(scope)
    return _median_us(check), len(managers)


def _warm_up() -> None:
    """One convert and one compile of a tiny model: the one-time imports are not a first call."""
    tiny = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    _step_time(convbn.convert(copy.deepcopy(tiny)), x)
    _step_time(convbn.convert(copy.deepcopy(tiny), example_inputs=x), x)
    _step_time(torch.compile(copy.deepcopy(tiny), backend="eager"), x)
    reset()


def run_resnet50(rounds: int = 5, batch: int = 8) -> Dict[str, Any]:  # one sequence of timed phases
    """First-call and per-call figures on torchvision's ResNet-50 (see the module docstring)."""
    import torch._dynamo.guards as dynamo_guards
    from zoo import import_torchvision_without_fake_kernels

    tv = import_torchvision_without_fake_kernels()
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return tv.models.resnet50()

    _warm_up()
    rec: Dict[str, Any] = {"batch": batch, "threads": torch.get_num_threads(), "rounds": rounds}
    eager = fresh()
    rec["eager_first_step_s"] = _step_time(eager, x)
    models: Dict[str, nn.Module] = {"eager": eager}
    for key, ei in (("convbn", None), ("convbn-ei", x)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            models[key] = convbn.convert(fresh(), example_inputs=ei)
            rec[f"{key}_convert_s"] = time.perf_counter() - t
            rec[f"{key}_first_step_s"] = _step_time(models[key], x)
    captured: List[Tuple[Any, Dict[str, Any]]] = []
    dynamo_guards.guard_manager_testing_hook_fn = lambda gm, scope, builder: captured.append((gm, dict(scope)))
    try:
        models["dynamo"] = torch.compile(fresh(), backend="eager")
        rec["dynamo_first_step_s"] = _step_time(models["dynamo"], x)
    finally:
        dynamo_guards.guard_manager_testing_hook_fn = None
    rec["dynamo"] = dynamo_counters()
    rec["convbn_fused"] = len(models["convbn"].convbn_report.pairs)
    times: Dict[str, List[float]] = {k: [] for k in models}
    for _ in range(rounds):  # interleaved: the machine's load falls on every configuration alike
        for key, m in models.items():
            m.zero_grad(set_to_none=True)
            times[key].append(_step_time(m, x))
    rec["step_rounds_s"] = times
    rec["step_s"] = {k: statistics.median(v) for k, v in times.items()}
    rec["step_ratio"] = {k: v / rec["step_s"]["eager"] for k, v in rec["step_s"].items()}
    rec["convbn_guard_us"], rec["convbn_guarded_modules"] = _convbn_guard_us(models["convbn"])
    rec["convbn-ei_guard_us"], rec["convbn-ei_guarded_modules"] = _convbn_guard_us(models["convbn-ei"])
    rec["dynamo_guard_us"], rec["dynamo_frames"] = _dynamo_guard_us(captured)
    return rec


def resnet50_table(r: Dict[str, Any]) -> str:
    """The markdown table of the ``resnet50`` part."""
    eager = r["step_s"]["eager"]
    rows = [("eager", "", r["eager_first_step_s"], "eager", ""),
            ("convbn.convert(model)", f"{r['convbn_convert_s']:.2f}", r["convbn_first_step_s"], "convbn",
             f"{r['convbn_guard_us']:.0f} ({r['convbn_guarded_modules']} modules)"),
            ("convbn.convert(model, example_inputs=x)", f"{r['convbn-ei_convert_s']:.2f}",
             r["convbn-ei_first_step_s"], "convbn-ei",
             f"{r['convbn-ei_guard_us']:.0f} ({r['convbn-ei_guarded_modules']} modules)"),
            ("torch.compile(model, backend=\"eager\")", "", r["dynamo_first_step_s"], "dynamo",
             f"{r['dynamo_guard_us']:.0f} ({r['dynamo_frames']} frame(s))")]
    lines = [f"ResNet-50 b{r['batch']} 224x224, CPU float32, {r['threads']} thread(s), {r['rounds']} interleaved rounds; "
             f"eager step {eager:.2f} s", "",
             "| capture | convert s | first step s (convert + first step) | later step s (x eager) | guard check us/call |",
             "|---|---:|---:|---:|---:|"]
    for name, conv, first, key, guard in rows:
        total = first + (float(conv) if conv else 0.0)
        lines.append(f"| {name} | {conv or '-'} | {first:.2f} ({total:.2f}) | {r['step_s'][key]:.2f} "
                     f"({r['step_ratio'][key]:.3f}x) | {guard or '-'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- (c) sweep coverage

SWEEP = ["hf:ResNet", "hf:MobileNetV1", "hf:MobileNetV2", "hf:EfficientNet", "hf:RegNet", "hf:MobileViT",
         "hf:UperNet-ConvNext", "hf:FastSpeech2Conformer", "kornia:HardNet", "kornia:SOSNet", "kornia:AffNet",
         "kornia:XFeat", "kornia:TinyViT", "yolo:yolov5n", "yolo:yolov8n", "yolo:yolo11n", "tv:resnet18",
         "tv:mobilenet_v3_small", "tv:efficientnet_b0", "tv:shufflenet_v2_x0_5", "tv:regnet_x_400mf"]


def _build(label: str) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    import bm_sweep

    family, _, name = label.partition(":")
    if family == "tv":
        from zoo import import_torchvision_without_fake_kernels

        tv = import_torchvision_without_fake_kernels()
        torch.manual_seed(0)
        return tv.models.__dict__[name]().train(), (torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)),)
    return bm_sweep.build(*bm_sweep.MODELS[label][:2])


def run_sweep_model(label: str) -> Dict[str, Any]:  # one model: eager, convbn, Dynamo, each a step
    """BatchNorms called in eager training, convbn's fused-and-running count (second step,
    without ``example_inputs``), Dynamo's graphs, breaks and batch norms seen; a record."""
    import bm_sweep

    torch.set_num_threads(1)
    model, inputs = _build(label)
    rec: Dict[str, Any] = {"label": label}
    eager = copy.deepcopy(model)
    called, handles = bm_sweep._bn_hooks(eager)
    ref = bm_sweep._step(eager, inputs)
    for h in handles:
        h.remove()
    rec["bn_called"] = len(called)
    t = time.perf_counter()
    res = bm_sweep._check_convert(copy.deepcopy(model), inputs, False, ref, called, "float32")
    rec["convbn"] = {k: res.get(k) for k in ("ok", "error", "fused_ran", "fused_ran_next", "report_fused",
                                                 "report_fused_next")}
    rec["convbn"]["s"] = time.perf_counter() - t
    reset()
    probe = Probe()
    twin = copy.deepcopy(model)
    t = time.perf_counter()
    try:
        compiled = torch.compile(twin, backend=probe)
        twin.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        out = compiled(*inputs)
        bm_sweep._loss(out).backward()
        state = twin.state_dict(keep_vars=True)
        got = {"out": [t_.detach() for t_ in bm_sweep._leaves(out)],
               "grads": {k: v.grad for k, v in state.items() if isinstance(v, nn.Parameter)},
               "buffers": {k: v.detach().clone() for k, v in state.items() if not isinstance(v, nn.Parameter)}}
        errs = bm_sweep._compare(ref, got)
        rec["dynamo"] = {"ok": max(errs.values()) <= bm_sweep.TOL["float32"], **probe.summary(), **dynamo_counters()}
    except Exception as exc:  # noqa: BLE001 - recorded: Dynamo raised where eager trains
        rec["dynamo"] = {"ok": False, "error": bm_sweep._short(exc), **probe.summary(), **dynamo_counters()}
    rec["dynamo"]["s"] = time.perf_counter() - t
    return rec


def sweep(labels: List[str], timeout: float) -> List[Dict[str, Any]]:
    """Each model in its own subprocess (a crash or a hang costs one row)."""
    records = []
    for label in labels:
        cmd = [sys.executable, os.path.abspath(__file__), "sweep-one", label]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            rec = json.loads(lines[-1]) if lines else {"label": label, "error": proc.stderr.strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            rec = {"label": label, "error": f"timed out after {timeout:.0f} s"}
        print(json.dumps(rec)[:300], flush=True)
        records.append(rec)
    return records


def sweep_table(records: List[Dict[str, Any]]) -> str:
    """The markdown table of the ``sweep`` part, with totals."""
    lines = ["| model | BNs called | convbn: fused and running (step 2), = eager | Dynamo: graphs, graph breaks, "
             "BNs in graphs (inlined, lifted), Conv->BN pairs, = eager |", "|---|---:|---|---|"]
    tot = {"called": 0, "fused": 0, "bn": 0, "pairs": 0, "breaks": 0}
    for r in records:
        if "error" in r:
            lines.append(f"| {r['label']} | - | {r['error']} | |")
            continue
        c, d = r["convbn"], r["dynamo"]
        fused = c.get("fused_ran_next") or 0
        seen = d.get("bn_function", 0) + d.get("bn_module", 0)
        tot["called"] += r["bn_called"]
        tot["fused"] += fused
        tot["bn"] += seen
        tot["pairs"] += d.get("pairs", 0)
        tot["breaks"] += d.get("graph_breaks", 0)
        cres = "yes" if c.get("ok") else f"no: {c.get('error', '')[:50]}"
        dres = "yes" if d.get("ok") else f"no: {d.get('error', '')[:50]}"
        lines.append(f"| {r['label']} | {r['bn_called']} | {fused}, {cres} | {d.get('graphs', 0)}, "
                     f"{d.get('graph_breaks', 0)}, {seen} ({d.get('bn_function', 0)}, {d.get('bn_lifted', 0)}), "
                     f"{d.get('pairs', 0)}, {dres} |")
    lines.append(f"| **total** | {tot['called']} | {tot['fused']} | breaks {tot['breaks']}, BNs in graphs "
                 f"{tot['bn']}, pairs {tot['pairs']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- driver

def _save(name: str, data: Any) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"capture_vs_dynamo_{name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)


def main(argv: Optional[List[str]] = None) -> None:
    """Run one part (``cases``, ``resnet50``, ``sweep``), print its table, save its records."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["cases", "resnet50", "sweep", "sweep-one"])
    parser.add_argument("models", nargs="*", help="sweep: labels (default: SWEEP); sweep-one: one label")
    parser.add_argument("--rounds", type=int, default=5, help="resnet50: interleaved rounds of later steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900, help="sweep: seconds per model")
    args = parser.parse_args(argv)
    if args.part == "sweep-one":
        warnings.simplefilter("ignore")
        print(json.dumps(run_sweep_model(args.models[0]), default=str))
        return
    if args.part == "cases":
        records = run_cases()
        _save("cases", records)
        print(cases_table(records))
    elif args.part == "resnet50":
        rec = run_resnet50(args.rounds, args.batch)
        _save("resnet50", rec)
        print(resnet50_table(rec))
    else:
        records = sweep(args.models or SWEEP, args.timeout)
        _save("sweep", records)
        print(sweep_table(records))


if __name__ == "__main__":
    main()
