"""convert(example_inputs=x) at a training batch (8) on library models: where its check ran (the
first two samples or the whole batch: Note [the check on a slice of the batch]) and one training
step of the converted model against eager's (outputs, every parameter gradient, buffers).

    PYTHONPATH=src:tests python benchmarks/bm_convert_slice_check.py
"""
import sys, copy, time, traceback, torch
from zoo import import_torchvision_without_fake_kernels, import_timm as import_timm_without_fake_kernels
tv = import_torchvision_without_fake_kernels()
import convbn
import convbn.passes.check.slice_check as sc
seen = []
real = sc.check_on_slice
def spy(module, args, kwargs):
    r, at = real(module, args, kwargs); seen.append(at); return r, at
import convbn.passes.convert.api as api
api.check_on_slice = spy
def builders():
    for n in ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "densenet121", "regnet_x_400mf", "shufflenet_v2_x0_5", "squeezenet1_1", "convnext_tiny", "mnasnet0_5", "resnext50_32x4d"]:
        yield "tv:" + n, lambda n=n: getattr(tv.models, n)(num_classes=10), (8, 3, 64, 64)
    try:
        timm = import_timm_without_fake_kernels()
        for n in ["resnet50_gn", "convnext_atto", "poolformer_s12", "efficientnet_b0_gn", "edgenext_xx_small", "mobilevitv2_050"]:
            yield "timm:" + n, lambda n=n: timm.create_model(n, num_classes=10), (8, 3, 64, 64)
    except Exception as e:
        print("timm", e)
    try:
        from monai.networks.nets import BasicUNet, resnet18, DynUNet
        yield "monai:BasicUNet2d", lambda: BasicUNet(spatial_dims=2, in_channels=1, out_channels=2), (8, 1, 64, 64)
        yield "monai:resnet18", lambda: resnet18(spatial_dims=2, n_input_channels=3, num_classes=4), (8, 3, 64, 64)
    except Exception as e:
        print("monai", e)
def maxdiff(a, b):
    return max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)
for label, make, shape in builders():
    seen.clear()
    try:
        torch.manual_seed(0)
        m = make().train(); x = torch.randn(shape)
        ref = copy.deepcopy(m)
        t = time.process_time()
        fast = convbn.convert(m, example_inputs=x, progress=False)
        ct = time.process_time() - t
        outs = []
        for mm in (ref, fast):
            torch.manual_seed(1)
            mm.zero_grad(set_to_none=True)
            o = mm(x); o = o if isinstance(o, torch.Tensor) else o[0]
            o.float().square().mean().backward()
            outs.append((o.detach(), [p.grad for p in mm.parameters()], [b.clone() for b in mm.buffers()]))
        (o1, g1, b1), (o2, g2, b2) = outs
        rel = float((o1 - o2).abs().max() / (o1.abs().max() + 1e-12))
        gmax = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(g1, g2) if a is not None and b is not None)
        bm = maxdiff([b.float() for b in b1], [b.float() for b in b2])
        r = fast.convbn_report
        print(f"{label:28s} checked_at={seen} validated={r.validated[:2]} fused={len(list(convbn.fused_modules(fast)))} out_rel={rel:.1e} grad_rel={gmax:.1e} buf={bm:.1e} convert_cpu_s={ct:.1f}", flush=True)
    except Exception as e:
        print(f"{label:28s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        traceback.print_exc(limit=3)
