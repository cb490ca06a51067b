"""A training step's peak three ways, eager and converted (CPU): live tensors (``Timeline.peak``,
every step-peak figure convbn reports), live tensors with the kernels' scratch as
:mod:`convbn.memory.kernel_scratch` bounds it (``Timeline.process_peak``, what
:func:`convbn.max_batch` fits with), and the CPU allocator's exact bytes
(:func:`convbn.memory.allocator_peak`)::

    PYTHONPATH=src:tests:benchmarks OMP_NUM_THREADS=1 python benchmarks/bm_step_scratch.py
"""
from __future__ import annotations

import copy

import torch

from zoo import import_torchvision_without_fake_kernels

import convbn
from convbn.memory import allocator_peak, timeline

#: (torchvision model, image size, batch)
CASES = [("resnet18", 112, 8), ("resnet50", 112, 8)]


def main() -> None:
    import_torchvision_without_fake_kernels()
    import torchvision

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, SGD momentum 0.9, MiB")
    print("| model | side | tensors | with the kernels' scratch | CPU allocator |")
    print("|---|---|---:|---:|---:|")
    for name, size, batch in CASES:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)()
        x = torch.randn(batch, 3, size, size)
        converted = convbn.convert(copy.deepcopy(model), example_inputs=x)
        for side, net in (("eager", model), ("convbn", converted)):
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            timeline(net, x, optimizer=opt)  # warm-up: the optimizer's state
            tl = timeline(net, x, optimizer=opt, kernel_scratch=True)
            alloc = allocator_peak(lambda: timeline(net, x, optimizer=opt))
            print(f"| {name} {size}² b{batch} | {side} | {tl.peak / 2**20:.1f} | {tl.process_peak / 2**20:.1f} "
                  f"| {alloc / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
