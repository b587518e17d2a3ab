"""Wide ResNet with bottleneck blocks (Zagoruyko & Komodakis, 2016; the ImageNet variant of
torchvision, ResNet v1.5 with the stride on the 3x3 convolution): the non-transformer family,
whose stages repeat blocks of *different* shapes, so folding must keep them apart."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelSpecError


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_per_group: int = 128          # 64 = plain ResNet, 128 = "wide ... _2"
    num_classes: int = 1000
    image_size: int = 224

    def __post_init__(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers) or self.width_per_group < 1:
            raise ModelSpecError(f"invalid resnet config: layers {self.layers} must be positive block "
                                 f"counts and width_per_group ({self.width_per_group}) positive")

    def to_dict(self) -> dict:
        return asdict(self)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int, width_per_group: int) -> None:
        super().__init__()
        width = planes * width_per_group // 64
        out_ch = planes * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class WideResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, in_ch = [], 64
        for i, blocks in enumerate(cfg.layers):
            planes = 64 * 2**i
            stage = []
            for j in range(blocks):
                stage.append(Bottleneck(in_ch, planes, 2 if (i > 0 and j == 0) else 1, cfg.width_per_group))
                in_ch = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_ch, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return F.cross_entropy(logits.float(), labels)
