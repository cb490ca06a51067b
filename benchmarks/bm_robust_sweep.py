"""Never crash, never raise from a check, never lie: convert and fold on model libraries no sweep ran before.

Libraries (``requirements-sweep.txt``, installed ``--no-deps``), networks built without weights:

* ``ocr``: ``easyocr`` -- the CRAFT text detector (VGG16-BN U-Net) and both CRNN recognisers
  (VGG and ResNet feature extractors, BiLSTM heads).
* ``video``: ``pytorchvideo`` -- X3D, slow ResNet-50, R(2+1)D, CSN (3-D convolutions, BatchNorm3d).
* ``reid``: ``torchreid`` -- person re-identification nets (OSNet, MLFN, PCB, ResNet-50
  with its BatchNorm1d neck, ShuffleNet, MobileNetV2).
* ``gan``: ``torchgan`` -- DCGAN / conditional generators (ConvTranspose -> BatchNorm) and
  discriminators, an energy-based auto-encoding discriminator.
* ``tabular``: ``pytorch_tabnet`` -- TabNet and its pre-training net (ghost BatchNorm1d over
  virtual batches, sparsemax attention).
* ``flows``: ``normflows`` -- the residual MLP / convolutional coupling nets with BatchNorm.

Each model runs in a subprocess (a segmentation fault is a ``crash``, not the end of the sweep):
``convert`` and ``fold``, each with and without ``example_inputs``, then

* ``raised``: the pass, a step of its result, or a check raised where eager did not;
* ``round trip``: ``torch.save`` / ``torch.load`` of the whole model, ``pickle`` and
  ``copy.deepcopy`` of the result fail where the user's model's succeed, or the copy computes
  otherwise;
* ``report = calls``: the BatchNorms the report lists fused / folded equal eager's batch-norm
  calls minus those that still run in eager form in the result (after two training steps,
  the first-call checks done);
* ``peak``: the exact peak of a training step (``convbn.memory.timeline``, optimizer step
  included) of the converted model over eager's, with and without ``example_inputs``.

Run::

    pip install --no-deps -r benchmarks/requirements-sweep.txt
    python benchmarks/bm_robust_sweep.py                # every library
    python benchmarks/bm_robust_sweep.py --family gan   # one
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

Built = Tuple[Any, Tuple[Any, ...]]


def _lenient(module: str) -> Any:
    from sweep_more_libs import _stand_in, import_lenient
    from zoo import import_torchvision_without_fake_kernels

    import_torchvision_without_fake_kernels()
    if "torch.utils.tensorboard" not in sys.modules:
        _stand_in("torch.utils.tensorboard")  # torchreid imports its writer; tensorboard is absent
    return import_lenient(module)


def _ocr(name: str) -> Built:
    import torch

    if name == "craft":
        return _lenient("easyocr.craft").CRAFT(pretrained=False, freeze=False), (torch.randn(2, 3, 64, 64),)
    mod = _lenient(f"easyocr.model.{name}")
    return mod.Model(1, 64, 32, 20), (torch.randn(2, 1, 32, 100), torch.zeros(2, 1, dtype=torch.long))


def _video(name: str) -> Built:
    import torch

    _lenient("fvcore")
    mods = {n: _lenient(f"pytorchvideo.models.{n}") for n in ("x3d", "resnet", "r2plus1d", "csn")}
    if name == "x3d":
        return (mods["x3d"].create_x3d(input_clip_length=4, input_crop_size=32, model_num_class=5),
                (torch.randn(2, 3, 4, 32, 32),))
    kw = dict(model_num_class=5, stem_dim_out=8)
    if name == "resnet":
        return (mods["resnet"].create_resnet(model_depth=50, head_pool_kernel_size=(1, 2, 2), **kw),
                (torch.randn(2, 3, 4, 64, 64),))
    if name == "r2plus1d":
        return mods["r2plus1d"].create_r2plus1d(head_pool_kernel_size=(1, 2, 2), **kw), (torch.randn(2, 3, 8, 64, 64),)
    return mods["csn"].create_csn(head_pool_kernel_size=(1, 1, 1), **kw), (torch.randn(2, 3, 4, 64, 64),)


def _reid(name: str) -> Built:
    import torch

    models = _lenient("torchreid.reid.models")
    return models.build_model(name, num_classes=10, pretrained=False, loss="softmax"), (torch.randn(2, 3, 64, 32),)


def _gan(name: str) -> Built:
    import torch

    g = _lenient("torchgan.models")
    if name == "dcgan_g":
        return g.DCGANGenerator(encoding_dims=16, out_size=32, out_channels=3, step_channels=8), (torch.randn(4, 16),)
    if name == "cond_g":
        return (g.ConditionalGANGenerator(num_classes=5, encoding_dims=16, out_size=32, out_channels=3, step_channels=8),
                (torch.randn(4, 16), torch.randint(0, 5, (4,))))
    if name == "dcgan_d":
        return g.DCGANDiscriminator(in_size=32, in_channels=3, step_channels=8), (torch.randn(4, 3, 32, 32),)
    return (g.AutoEncodingDiscriminator(in_size=32, in_channels=3, step_channels=8, energy=True, embeddings=False),
            (torch.randn(4, 3, 32, 32),))


def _tabular(name: str) -> Built:
    import torch

    tn = _lenient("pytorch_tabnet.tab_network")
    if name == "tabnet":
        x = torch.randn(32, 16)
        return tn.TabNet(16, 3, n_d=8, n_a=8, n_steps=3, virtual_batch_size=8,
                         group_attention_matrix=torch.eye(16)), (x,)
    return (tn.TabNetPretraining(16, n_d=8, n_a=8, n_steps=3, virtual_batch_size=8, pretraining_ratio=0.2,
                                 group_attention_matrix=torch.eye(16)), (torch.randn(32, 16),))


def _flows(name: str) -> Built:
    import torch

    nets = _lenient("normflows.nets")
    if name == "residual":
        return nets.ResidualNet(8, 8, hidden_features=16, num_blocks=2, use_batch_norm=True), (torch.randn(8, 8),)
    return nets.ConvResidualNet(3, 6, hidden_channels=8, num_blocks=2, use_batch_norm=True), (torch.randn(2, 3, 8, 8),)


FAMILIES: Dict[str, Tuple[Callable[[str], Built], Tuple[str, ...]]] = {
    "ocr": (_ocr, ("craft", "vgg_model", "model")),
    "video": (_video, ("x3d", "resnet", "r2plus1d", "csn")),
    # (HACNN is left out: its forward calls .cuda())
    "reid": (_reid, ("osnet_x0_25", "mlfn", "pcb_p4", "resnet50", "shufflenet", "mobilenetv2_x1_0")),
    "gan": (_gan, ("dcgan_g", "cond_g", "dcgan_d", "autoenc_d")),
    "tabular": (_tabular, ("tabnet", "pretrain")),
    "flows": (_flows, ("residual", "conv_residual")),
}


def _loss(out: Any) -> Any:
    import torch

    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)


def _round_trips(model: Any) -> Dict[str, Callable[[Any], Any]]:
    import torch

    def save_load(m: Any) -> Any:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    return {"torch.save": save_load, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "deepcopy": copy.deepcopy}


def _trip_failures(user: Any, result: Any, args: Tuple[Any, ...], train: bool) -> List[str]:
    """The round trips the user's model survives and ``result`` does not (or computes otherwise after)."""
    import torch

    failed = []
    for name, trip in _round_trips(user).items():
        try:
            trip(user)
        except Exception:  # noqa: BLE001 - the user's model does not round-trip this way: not asked of convbn
            continue
        try:
            with torch.no_grad():
                torch.manual_seed(0)
                want = result.train(train)(*args)
                loaded = trip(result).train(train)
                torch.manual_seed(0)
                got = loaded(*args)
            if not all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(
                    torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))
                    if isinstance(a, torch.Tensor) and a.is_floating_point()):
                failed.append(f"{name}: computes otherwise")
        except Exception as exc:  # noqa: BLE001 - recorded
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
    return failed


def _peak(model: Any, args: Tuple[Any, ...]) -> int:
    import torch
    from convbn.memory import timeline

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return timeline(model, *args, optimizer=opt, loss_fn=_loss).peak


def _one_pass(family: str, name: str, pass_name: str, with_inputs: bool) -> Dict[str, Any]:
    """One pass on a fresh model: raised, round trips, report against calls, peak ratio."""
    import torch

    import convbn
    from bn_calls import eager_bn_calls

    torch.manual_seed(0)
    model, args = FAMILIES[family][0](name)
    train = pass_name == "convert"
    model.train(train)
    rec: Dict[str, Any] = {"pass": pass_name, "with_inputs": with_inputs}
    with torch.no_grad():
        model(*args)
    eager_calls = eager_bn_calls(model, *args)
    eager_peak = _peak(copy.deepcopy(model), args) if train and _copyable(model) else None
    user = copy.deepcopy(model) if _copyable(model) else None
    try:
        run = convbn.convert if train else convbn.fold
        result = run(model, example_inputs=args if with_inputs else None)
        for _ in range(2):
            if train:
                result.zero_grad(set_to_none=True)
                _loss(result(*args)).backward()
            else:
                with torch.no_grad():
                    result(*args)
    except Exception as exc:  # noqa: BLE001 - recorded
        rec["raised"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return rec
    rec["eager_calls"] = eager_calls
    with torch.set_grad_enabled(train):
        rec["left_calls"] = eager_bn_calls(result, *args)
    rec["listed"] = sum(o.result == ("fused" if train else "folded") for o in result.convbn_report.outcomes)
    if eager_peak:
        rec["peak_ratio"] = _peak(result, args) / eager_peak
    rec["round_trip_failures"] = _trip_failures(user, result, args, train) if user is not None else []
    return rec


def _copyable(model: Any) -> bool:
    try:
        copy.deepcopy(model)
        return True
    except Exception:  # noqa: BLE001 - a model that refuses deepcopy
        return False


def run_model(label: str) -> Dict[str, Any]:
    """Every pass on the model ``family:name`` (in this process)."""
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    family, name = label.split(":", 1)
    try:
        torch.manual_seed(0)
        model, args = FAMILIES[family][0](name)
        model.train()
        _loss(model(*args)).backward()
        bns = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    except Exception as exc:  # noqa: BLE001 - the library itself does not build / run here
        return {"label": label, "skipped": f"{type(exc).__name__}: {str(exc)[:200]}"}
    passes = [_one_pass(family, name, p, w) for p in ("convert", "fold") for w in (True, False)]
    return {"label": label, "bn_modules": bns, "passes": passes}


def _in_subprocess(label: str, timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", label], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"label": label, "timeout": timeout}
    if proc.returncode != 0:
        return {"label": label, "crash": proc.returncode, "stderr": proc.stderr[-800:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(family: str, recs: List[Dict[str, Any]]) -> str:
    ran = [r for r in recs if "passes" in r]
    passes = [p for r in ran for p in r["passes"]]
    crashes = sum("crash" in r for r in recs)
    raised = sum("raised" in p for p in passes)
    trips = sum(len(p.get("round_trip_failures", ())) for p in passes)
    checked = [p for p in passes if "listed" in p]
    exact = sum(p["listed"] == p["eager_calls"] - p["left_calls"] for p in checked)
    gone = sum(p["eager_calls"] - p["left_calls"] for p in checked if p["pass"] == "convert")
    calls = sum(p["eager_calls"] for p in checked if p["pass"] == "convert")
    peaks = [p["peak_ratio"] for p in passes if "peak_ratio" in p]
    worst = f"{max(peaks):.3f}" if peaks else "-"
    skipped = sum("skipped" in r or "timeout" in r for r in recs)
    return (f"| {family} | {len(ran)} ({skipped} not run) | {crashes} | {raised} | {trips} | {exact} / {len(checked)} "
            f"| {gone} / {calls} | {worst} |")


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", choices=sorted(FAMILIES))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "bm_robust_sweep.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.one:
        print(json.dumps(run_model(opts.one)))
        return 0
    records: Dict[str, List[Dict[str, Any]]] = {}
    for family in opts.family or sorted(FAMILIES):
        for name in FAMILIES[family][1]:
            rec = _in_subprocess(f"{family}:{name}", opts.timeout)
            print(json.dumps(rec), file=sys.stderr, flush=True)
            records.setdefault(family, []).append(rec)
    os.makedirs(os.path.dirname(opts.json), exist_ok=True)
    with open(opts.json, "w") as f:
        json.dump(records, f, indent=1)
    print("| library | models run | crashes | raised | round-trip failures | report = calls (passes) "
          "| BN calls gone, convert (all) | worst peak / eager |")
    print("|---|---|---|---|---|---|---|---|")
    for family, recs in records.items():
        print(_summary(family, recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
