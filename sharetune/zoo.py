"""A small built-in model zoo: no downloads, deterministic weights, eval mode, batch 1.

Each entry's ``build()`` returns ``(module, example_inputs)``; calling it twice gives identical
weights and inputs (both come from ``torch.manual_seed``).  torch is imported only when a model is
built, so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from shared.errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    import torch

SEED = 0


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    build: Callable[[], "tuple[torch.nn.Module, tuple[torch.Tensor, ...]]"]


def _finish(model, *shapes):
    """Put ``model`` in eval mode and make seeded example inputs of the given shapes."""
    import torch

    model.eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    inputs = tuple(torch.randn(*shape, generator=gen) for shape in shapes)
    return model, inputs


def _randomize_batchnorm(model) -> None:
    """Give BatchNorm layers non-trivial (but seeded) statistics so they are not identities."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)


# --------------------------------------------------------------------------------------------
# ResNet-18
# --------------------------------------------------------------------------------------------


def _build_resnet18():
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            skip = x if self.down is None else self.down(x)
            return torch.relu(out + skip)

    class ResNet18(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
            layers = []
            cin = 64
            for i, cout in enumerate((64, 128, 256, 512)):
                stride = 1 if i == 0 else 2
                layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.layers = nn.Sequential(*layers)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.layers(self.stem(x))
            x = torch.flatten(self.pool(x), 1)
            return self.fc(x)

    torch.manual_seed(SEED)
    model = ResNet18()
    _randomize_batchnorm(model)
    return _finish(model, (1, 3, 224, 224))


# --------------------------------------------------------------------------------------------
# MobileNetV2
# --------------------------------------------------------------------------------------------


# (expansion t, output channels c, repeats n, first stride s): the MobileNetV2 table,
# slimmed to fewer repeats so conversion and tuning stay quick.
MOBILENETV2_BLOCKS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 2, 2),
    (6, 64, 2, 2),
    (6, 96, 1, 1),
    (6, 160, 2, 2),
    (6, 320, 1, 1),
)


def _mobilenetv2_parts(nn):
    """MobileNetV2's two building blocks over torch.nn: conv_bn (conv, batch norm, ReLU6 unless act=False) and
    InvertedResidual (expansion, depthwise, linear bottleneck)."""

    def conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1, act: bool = True):
        layers = [
            nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act:
            layers.append(nn.ReLU6())
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            layers = []
            if expand != 1:
                layers.append(conv_bn(cin, hidden, 1, 1))  # pointwise expansion
            layers.append(conv_bn(hidden, hidden, 3, stride, groups=hidden))  # depthwise
            layers.append(conv_bn(hidden, cout, 1, 1, act=False))  # linear bottleneck
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            out = self.body(x)
            return x + out if self.residual else out

    return conv_bn, InvertedResidual


def _build_mobilenetv2():
    import torch
    from torch import nn

    conv_bn, InvertedResidual = _mobilenetv2_parts(nn)

    class MobileNetV2(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            layers = [conv_bn(3, 32, 3, 2)]
            cin = 32
            for t, c, n, s in MOBILENETV2_BLOCKS:
                for i in range(n):
                    layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers.append(conv_bn(cin, 1280, 1, 1))
            self.features = nn.Sequential(*layers)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Linear(1280, num_classes)

        def forward(self, x):
            x = torch.flatten(self.pool(self.features(x)), 1)
            return self.classifier(x)

    torch.manual_seed(SEED)
    model = MobileNetV2()
    _randomize_batchnorm(model)
    return _finish(model, (1, 3, 224, 224))


# --------------------------------------------------------------------------------------------
# Transformer encoder block
# --------------------------------------------------------------------------------------------


def _build_transformer():
    import math

    import torch
    from torch import nn

    class EncoderBlock(nn.Module):
        def __init__(self, d_model: int = 256, heads: int = 4, mlp_ratio: int = 4):
            super().__init__()
            self.heads = heads
            self.d_head = d_model // heads
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
            self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

        def forward(self, x):
            b, s, d = x.shape
            h = self.ln1(x)
            qkv = self.qkv(h).reshape(b, s, 3, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # each (b, heads, s, d_head)
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_head)
            attn = torch.softmax(scores, dim=-1)
            ctx = torch.matmul(attn, v).permute(0, 2, 1, 3).reshape(b, s, d)
            x = x + self.proj(ctx)
            h = self.fc2(torch.relu(self.fc1(self.ln2(x))))
            return x + h

    torch.manual_seed(SEED)
    return _finish(EncoderBlock(), (1, 64, 256))


# --------------------------------------------------------------------------------------------
# Tiny and small CNNs for tests and demos
# --------------------------------------------------------------------------------------------


def _build_tiny():
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, 1, 1)
            self.fc = nn.Linear(8 * 16 * 16, 10)

        def forward(self, x):
            x = torch.relu(self.conv(x))
            return self.fc(torch.flatten(x, 1))

    torch.manual_seed(SEED)
    return _finish(Tiny(), (1, 3, 16, 16))


def _build_small_cnn():
    import torch
    from torch import nn

    class SmallCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, 1, 1)
            self.conv2 = nn.Conv2d(16, 32, 3, 2, 1)
            self.conv3 = nn.Conv2d(32, 32, 3, 2, 1)
            self.fc = nn.Linear(32 * 8 * 8, 10)

        def forward(self, x):
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            x = torch.relu(self.conv3(x))
            return self.fc(torch.flatten(x, 1))

    torch.manual_seed(SEED)
    return _finish(SmallCNN(), (1, 3, 32, 32))


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            "resnet18",
            "ResNet-18-like CNN: BasicBlock x [2,2,2,2], widths 64..512, input 1x3x224x224",
            _build_resnet18,
        ),
        ZooModel(
            "mobilenetv2",
            "MobileNetV2-like CNN (slimmed repeats): inverted residuals, depthwise convs, ReLU6, "
            "input 1x3x224x224",
            _build_mobilenetv2,
        ),
        ZooModel(
            "transformer",
            "One transformer encoder block: 4-head self-attention + MLP, seq 64, d_model 256, "
            "input 1x64x256",
            _build_transformer,
        ),
        ZooModel(
            "tiny",
            "conv2d 3->8 3x3 + relu, flatten, linear to 10; input 1x3x16x16 (a few tuning tasks)",
            _build_tiny,
        ),
        ZooModel(
            "small_cnn",
            "three conv2d+relu, flatten, linear to 10; input 1x3x32x32 (demo size)",
            _build_small_cnn,
        ),
    )
}


def get(name: str) -> ZooModel:
    """The zoo entry called ``name``; ModelError naming the known ones if there is none."""
    try:
        return ZOO[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ZOO))
        raise ModelError(f"unknown zoo model {name!r}; known models: {known}") from None
