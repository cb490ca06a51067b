"""The scratch a CPU convolution's kernel allocates inside the operator (oneDNN's reordered
operands): not tensors, so no tensor meter (``timeline``, ``tensor_peak``) sees it, yet it is the
process's memory while the operator runs (Note: [what answering holds above the limit] in
``src/convbn/batch_search.py``).

For each convolution (ResNet-50's shapes, at batches 8 and 21, contiguous and channels-last; a
setup not measured), the CPU allocator's peak inside ``aten.convolution`` and
``aten.convolution_backward`` (:func:`convbn.memory.allocator_peak`) less their outputs, as a
fraction of the operands' bytes (forward: input, weight, output; backward: incoming gradient,
input, weight)::

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/bm_conv_scratch.py
"""
from __future__ import annotations

import torch

from convbn.memory import allocator_peak

aten = torch.ops.aten

#: (batch, in channels, size, out channels, kernel, stride): ResNet-50's convolutions
CONVS = [(8, 3, 224, 64, 7, 2), (8, 64, 56, 64, 1, 1), (8, 64, 56, 64, 3, 1), (8, 64, 56, 256, 1, 1),
         (8, 256, 56, 128, 1, 1), (8, 128, 56, 128, 3, 2), (8, 512, 28, 256, 1, 1), (8, 256, 14, 256, 3, 1),
         (8, 1024, 14, 512, 1, 1), (8, 512, 7, 512, 3, 1), (8, 512, 14, 2048, 1, 2), (21, 64, 56, 64, 3, 1),
         (21, 3, 224, 64, 7, 2)]


def main() -> None:
    mib = 2 ** 20
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| layout | conv (N, Cin, H, Cout, k, s) | forward scratch (x operands) | backward scratch (x operands) "
          "|")
    print("|---|---|---:|---:|")
    worst = {"forward": 0.0, "backward": 0.0}
    for cl in (False, True):  # contiguous, then channels-last
        for n, c, h, o, k, s in CONVS:
            x, w = torch.randn(n, c, h, h), torch.randn(o, c, k, k)
            if cl:
                x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
            fwd_args = (x, w, None, [s, s], [k // 2] * 2, [1, 1], False, [0, 0], 1)
            y = aten.convolution.default(*fwd_args)
            gy = torch.randn_like(y)
            bwd_args = (gy, x, w, None, [s, s], [k // 2] * 2, [1, 1], False, [0, 0], 1, [True, True, False])
            fwd = allocator_peak(lambda: aten.convolution.default(*fwd_args)) - y.nbytes
            bwd = allocator_peak(lambda: aten.convolution_backward.default(*bwd_args)) - x.nbytes - w.nbytes
            f_ops, b_ops = x.nbytes + w.nbytes + y.nbytes, gy.nbytes + x.nbytes + w.nbytes
            worst["forward"] = max(worst["forward"], fwd / f_ops)
            worst["backward"] = max(worst["backward"], bwd / b_ops)
            print(f"| {'channels-last' if cl else 'contiguous'} | {n}, {c}, {h}, {o}, {k}, {s} "
                  f"| {fwd / mib:.2f} MiB ({fwd / f_ops:.2f}) | {bwd / mib:.2f} MiB ({bwd / b_ops:.2f}) |",
                  flush=True)
    print(f"worst: forward {worst['forward']:.2f}, backward {worst['backward']:.2f} of the operands' bytes")


if __name__ == "__main__":
    main()
