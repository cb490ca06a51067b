"""Small self-contained models of the kinds issue 40 met: point clouds (PointNet with its input and
feature transforms, DGCNN edge convolutions), a tabular net of Linear -> BatchNorm1d blocks, a
residual block net, a TabNet-style ghost BatchNorm (one BatchNorm over chunks of the batch)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn
class STN(nn.Module):
    def __init__(self, k=3):
        super().__init__(); self.k = k
        self.c1, self.c2, self.c3 = nn.Conv1d(k, 16, 1), nn.Conv1d(16, 32, 1), nn.Conv1d(32, 64, 1)
        self.b1, self.b2, self.b3 = nn.BatchNorm1d(16), nn.BatchNorm1d(32), nn.BatchNorm1d(64)
        self.f1, self.f2, self.f3 = nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(16, k * k)
        self.b4, self.b5 = nn.BatchNorm1d(32), nn.BatchNorm1d(16)
    def forward(self, x):
        b = x.size(0)
        x = F.relu(self.b1(self.c1(x))); x = F.relu(self.b2(self.c2(x))); x = F.relu(self.b3(self.c3(x)))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, 64)
        x = F.relu(self.b4(self.f1(x))); x = F.relu(self.b5(self.f2(x))); x = self.f3(x)
        iden = torch.eye(self.k, device=x.device).flatten().unsqueeze(0).repeat(b, 1)
        return (x + iden).view(-1, self.k, self.k)
class PointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stn = STN(3); self.fstn = STN(16)
        self.c1, self.c2, self.c3 = nn.Conv1d(3, 16, 1), nn.Conv1d(16, 32, 1), nn.Conv1d(32, 64, 1)
        self.b1, self.b2, self.b3 = nn.BatchNorm1d(16), nn.BatchNorm1d(32), nn.BatchNorm1d(64)
        self.f1, self.f2, self.f3 = nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(16, 5)
        self.b4, self.b5 = nn.BatchNorm1d(32), nn.BatchNorm1d(16); self.drop = nn.Dropout(0.3)
    def forward(self, x):
        t = self.stn(x); x = torch.bmm(x.transpose(2, 1), t).transpose(2, 1)
        x = F.relu(self.b1(self.c1(x)))
        t2 = self.fstn(x); x = torch.bmm(x.transpose(2, 1), t2).transpose(2, 1)
        x = F.relu(self.b2(self.c2(x))); x = self.b3(self.c3(x))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, 64)
        x = F.relu(self.b4(self.f1(x))); x = F.relu(self.b5(self.drop(self.f2(x))))
        return F.log_softmax(self.f3(x), dim=1)
def knn(x, k):
    inner = -2 * torch.matmul(x.transpose(2, 1), x); xx = torch.sum(x ** 2, dim=1, keepdim=True)
    return (-xx - inner - xx.transpose(2, 1)).topk(k=k, dim=-1)[1]
def graph_feature(x, k=4):
    b, c, n = x.size(); idx = knn(x, k) + torch.arange(0, b).view(-1, 1, 1) * n
    x = x.transpose(2, 1).contiguous(); f = x.view(b * n, -1)[idx.view(-1), :].view(b, n, k, c)
    x = x.view(b, n, 1, c).repeat(1, 1, k, 1)
    return torch.cat((f - x, x), dim=3).permute(0, 3, 1, 2).contiguous()
class DGCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.e1 = nn.Sequential(nn.Conv2d(6, 16, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2))
        self.e2 = nn.Sequential(nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2))
        self.c5 = nn.Sequential(nn.Conv1d(32, 64, 1, bias=False), nn.BatchNorm1d(64), nn.LeakyReLU(0.2))
        self.l1 = nn.Linear(128, 32, bias=False); self.bn6 = nn.BatchNorm1d(32); self.l2 = nn.Linear(32, 5)
    def forward(self, x):
        x1 = self.e1(graph_feature(x)).max(dim=-1)[0]
        x2 = self.e2(graph_feature(x1)).max(dim=-1)[0]
        x = self.c5(torch.cat((x1, x2), 1))
        x = torch.cat((F.adaptive_max_pool1d(x, 1).view(x.size(0), -1), F.adaptive_avg_pool1d(x, 1).view(x.size(0), -1)), 1)
        return self.l2(F.leaky_relu(self.bn6(self.l1(x)), 0.2))
class Tabular(nn.Module):
    def __init__(self, d=64, w=256, depth=4):
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [nn.Linear(d if i == 0 else w, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(0.1)]
        self.body = nn.Sequential(*layers); self.out = nn.Linear(w, 1)
    def forward(self, x): return self.out(self.body(x))
class ResBlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.a = nn.Conv2d(8, 8, 3, padding=1); self.ba = nn.BatchNorm2d(8)
        self.b = nn.Conv2d(8, 8, 3, padding=1); self.bb = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)
    def forward(self, x):
        x = self.stem(x); y = F.relu(self.ba(self.a(x))); y = self.bb(self.b(y))
        return self.head(F.relu(x + y).mean((2, 3)))
class GhostBN(nn.Module):
    """TabNet's ghost BatchNorm: one BatchNorm1d applied to each virtual batch."""

    def __init__(self, d: int, virtual: int = 8) -> None:
        super().__init__()
        self.bn, self.virtual = nn.BatchNorm1d(d), virtual

    def forward(self, x):
        chunks = x.chunk(max(1, x.shape[0] // self.virtual), 0)
        return torch.cat([self.bn(c) for c in chunks], 0)


class GhostTabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.g1 = nn.Linear(16, 32), GhostBN(32)
        self.fc2, self.b2 = nn.Linear(32, 32), nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        x = F.relu(self.g1(self.fc1(x)))
        return self.out(F.relu(self.b2(self.fc2(x))))


#: name -> (model factory, input factory)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "pointnet": (PointNet, lambda: torch.randn(4, 3, 32)),
    "dgcnn": (DGCNN, lambda: torch.randn(4, 3, 16)),
    "tabular": (lambda: Tabular(16, 32, 3), lambda: torch.randn(16, 16)),
    "resblock": (ResBlockNet, lambda: torch.randn(2, 3, 8, 8)),
    "ghost_tabular": (GhostTabular, lambda: torch.randn(32, 16)),
}
