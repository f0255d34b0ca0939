"""The synthetic benchmarks' default model (examples/horovod/pytorch_synthetic_benchmark.py and
benchmarks/synthetic_ddp.py, its torch DDP counterpart): no torchvision, nothing to download."""

import torch
import torch.nn as nn


class SmallCNN(nn.Module):
    """Three strided convolutions and a classifier: 224x224x3 images, 1000 classes."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=7, stride=4, padding=3), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))
