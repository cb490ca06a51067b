"""Two model patterns that made ``convert(example_inputs=...)`` slow (issue 40 item 7), written
here after their published shapes: an HRNet-style segmenter (parallel branches at several
resolutions, fused with each other again and again: hundreds of BatchNorms) and a CRNN-style
text recogniser (a Conv -> BN -> ReLU stack, then a bidirectional LSTM over the width)."""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["HRNetLike", "CRNNLike"]


def _cbr(cin: int, cout: int, stride: int = 1, relu: bool = True, k: int = 3) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class _Basic(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a, self.b = _cbr(c, c), _cbr(c, c, relu=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.b(self.a(x)))


class _HRModule(nn.Module):
    """Each branch: ``blocks`` basic blocks; then every output resolution sums every branch,
    brought to it by 1x1 conv + BN + upsampling (lower resolutions) or strided 3x3 convs (higher)."""

    def __init__(self, widths: List[int], blocks: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(*[_Basic(c) for _ in range(blocks)]) for c in widths)
        self.fuse = nn.ModuleList()
        for i, ci in enumerate(widths):
            row = nn.ModuleList()
            for j, cj in enumerate(widths):
                if j > i:
                    row.append(_cbr(cj, ci, relu=False, k=1))
                elif j < i:
                    steps = [_cbr(cj, cj, 2) for _ in range(i - j - 1)] + [_cbr(cj, ci, 2, relu=False)]
                    row.append(nn.Sequential(*steps))
                else:
                    row.append(nn.Identity())
            self.fuse.append(row)

    def forward(self, xs: List[Tensor]) -> List[Tensor]:
        xs = [b(x) for b, x in zip(self.branches, xs)]
        out = []
        for i, row in enumerate(self.fuse):
            y = xs[i]
            for j, f in enumerate(row):
                if j > i:
                    y = y + F.interpolate(f(xs[j]), size=xs[i].shape[-2:], mode="nearest")
                elif j < i:
                    y = y + f(xs[j])
            out.append(F.relu(y))
        return out


class HRNetLike(nn.Module):
    """HRNet-W18-like segmenter: stem, then stages of 2, 3 and 4 parallel branches (``modules``
    fusion modules each), a head over the upsampled concatenation."""

    def __init__(self, width: int = 18, modules: tuple = (1, 4, 3), blocks: int = 4, classes: int = 19) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbr(3, 64, 2), _cbr(64, 64, 2))
        widths = [width * 2 ** k for k in range(4)]
        self.trans1 = nn.ModuleList([_cbr(64, widths[0]), _cbr(64, widths[1], 2)])
        self.stage2 = nn.Sequential(*[_HRModule(widths[:2], blocks) for _ in range(modules[0])])
        self.trans2 = _cbr(widths[1], widths[2], 2)
        self.stage3 = nn.Sequential(*[_HRModule(widths[:3], blocks) for _ in range(modules[1])])
        self.trans3 = _cbr(widths[2], widths[3], 2)
        self.stage4 = nn.Sequential(*[_HRModule(widths, blocks) for _ in range(modules[2])])
        self.head = nn.Sequential(_cbr(sum(widths), sum(widths), k=1), nn.Conv2d(sum(widths), classes, 1))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        xs = [t(x) for t in self.trans1]
        xs = self.stage2(xs)
        xs = self.stage3(xs + [self.trans2(xs[-1])])
        xs = self.stage4(xs + [self.trans3(xs[-1])])
        size = xs[0].shape[-2:]
        y = torch.cat([xs[0]] + [F.interpolate(t, size=size, mode="bilinear", align_corners=False) for t in xs[1:]], 1)
        return self.head(y)


class CRNNLike(nn.Module):
    """CRNN-like recogniser (~3.3M parameters, 7 BatchNorms... per ``widths``): Conv -> BN -> ReLU
    stack with poolings to height 1, a 2-layer bidirectional LSTM over the width, a linear classifier."""

    def __init__(self, classes: int = 37, hidden: int = 256) -> None:
        super().__init__()
        cfg = [(1, 64), (64, 128), "P", (128, 256), (256, 256), "P", (256, 256), (256, 256), "P",
               (256, 256), (256, 256), (256, 256), (256, 256), (256, 256), "P"]
        layers: List[nn.Module] = []
        for c in cfg:
            if c == "P":
                layers.append(nn.MaxPool2d((2, 1), (2, 1)))
            else:
                layers.append(_cbr(*c))
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.LSTM(256, hidden // 2, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        f = self.cnn(x)  # N, C, 2, W
        f = f.mean(2).transpose(1, 2)  # N, W, C
        y, _ = self.rnn(f)
        return self.fc(y)
