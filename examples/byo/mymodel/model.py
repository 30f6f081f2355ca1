"""The owner's model: a small residual MLP classifier. Plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn


class MyNet(nn.Module):
    def __init__(self, features: int = 12, classes: int = 4, hidden: int = 64, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)
