"""A small residual convolutional network for 32 × 32 images: two stages of one basic block each."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """Two 3 × 3 convolutions with batch norm, added to the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """``model(images, labels)`` returns the classification cross-entropy."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.stage1 = BasicBlock(width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.stage2 = BasicBlock(2 * width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stage1(F.relu(self.stem(images)))
        h = self.stage2(F.relu(self.down(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), labels)
