"""``resnet``: a small ResNet (residual blocks, batch norm) on synthetic images.

Not an ``nn.Sequential``: the profiler and the runtime trace it with ``torch.export`` and cut it
at module boundaries, so stage boundaries can cut residual connections (the block input skips
over the convolutions to the addition at the end of the block).

Data: 3 x size x size images of oriented stripes whose orientation and frequency give the class,
plus noise; deterministic from ``data_seed``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError
from pipedream.workload import Workload
from pipedream.workloads.common import check_sizes, optimizer_factory, warmup_decay

__all__ = ["BasicBlock", "ResNet", "build"]


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn, plus the (projected) input, then relu."""

    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """stem -> layer1 .. layerN (each ``blocks`` BasicBlocks) -> global pool -> fc."""

    def __init__(self, *, width: int, stages: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        channels = width
        for index in range(stages):
            out = width * 2**index
            layer = nn.Sequential(
                *(
                    BasicBlock(channels if b == 0 else out, out, 2 if (b == 0 and index) else 1)
                    for b in range(blocks)
                )
            )
            self.add_module(f"layer{index + 1}", layer)
            channels = out
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for name, child in self.named_children():
            if name.startswith("layer"):
                x = child(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def _images(count: int, size: int, classes: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(torch_seed(seed))
    labels = torch.randint(0, classes, (count,), generator=generator)
    coords = torch.arange(size, dtype=torch.float32)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    angle = labels.float() * (math.pi / classes)
    frequency = 1.0 + (labels % 2).float()
    phase = xs[None] * torch.cos(angle)[:, None, None] + ys[None] * torch.sin(angle)[:, None, None]
    stripes = torch.sin(phase * frequency[:, None, None] * 2 * math.pi / size * 2)
    images = stripes[:, None].repeat(1, 3, 1, 1)
    images += 0.3 * torch.randn(images.shape, generator=generator)
    return images, labels


def build(
    width: int = 8,
    stages: int = 2,
    blocks: int = 2,
    classes: int = 4,
    size: int = 16,
    samples: int = 2048,
    optimizer: str = "sgd",
    lr: float = 0.05,
    momentum: float = 0.0,
    warmup: int = 0,
    decay: int = 0,
    seed: int = 0,
    data_seed: int = 1,
    microbatch_size: int = 16,
) -> Workload:
    """Build the ResNet workload; the same arguments give identical weights. ``warmup`` and
    ``decay`` schedule the learning rate (:func:`~pipedream.workloads.common.warmup_decay`)."""
    check_sizes(
        "resnet",
        width=width,
        stages=stages,
        blocks=blocks,
        size=size,
        samples=samples,
        microbatch_size=microbatch_size,
    )
    if classes < 2:
        raise WorkloadError(
            f"resnet: classes must be >= 2, got {classes}; with one class the loss is always 0"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        model = ResNet(width=width, stages=stages, blocks=blocks, classes=classes)
    images, labels = _images(samples, size, classes, data_seed)
    return Workload(
        model=model,
        example_input=images[torch.arange(microbatch_size) % samples],  # samples may be fewer
        loss_fn=nn.functional.cross_entropy,
        dataset=TensorDataset(images, labels),
        optimizer=optimizer_factory(optimizer, lr=lr, momentum=momentum),
        lr_schedule=warmup_decay("resnet", warmup, decay),
        description=f"ResNet ({stages} stages x {blocks} blocks, width {width}) on {size}x{size}",
    )
