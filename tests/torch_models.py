"""PyTorch twins of the CNN examples, with state_dict keys that map one to one onto
the examples' parameter names (dots as underscores): the oracle of tests/test_cnn.py."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 3, padding=1)
        self.c3 = nn.Conv2d(6, 16, 3, padding=1)
        self.f5 = nn.Linear(64, 120)
        self.f6 = nn.Linear(120, 84)
        self.logits = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c3(x)), 2)
        x = F.relu(self.f5(torch.flatten(x, 1)))
        return self.logits(F.relu(self.f6(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, stages = 64, []
        for channels, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            stages.append(nn.Sequential(BasicBlock(cin, channels, stride), BasicBlock(channels, channels, 1)))
            cin = channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.linear(x.mean(dim=(2, 3)))


class VGG11(nn.Module):
    def __init__(self):
        super().__init__()
        layers, cin = [], 3
        for item in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, item, 3, padding=1), nn.BatchNorm2d(item), nn.ReLU()]
                cin = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, 10)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


TWINS = {"lenet": LeNet, "resnet18": ResNet18, "vgg11": VGG11}


DENSE = {"lenet": ("f5", "f6", "logits")}  # layers written with dg.dense: `<name>_w` [in, out], `<name>_b`


def key(torch_name: str, dense=()) -> tuple:
    """(deepgen name, transposed?) of a state_dict key: dots become underscores; a
    dg.dense layer's Linear weight is `<name>_w`, stored [in, out]."""
    k = torch_name.replace(".", "_")
    base, what = k.rsplit("_", 1)
    if base in dense:
        return (f"{base}_w", True) if what == "weight" else (f"{base}_b", False)
    return k, False


def copy_into_torch(net: nn.Module, params: dict, buffers: dict, dense=()) -> None:
    """Load deepgen's parameters and running statistics into `net`."""
    state = {}
    for name, tensor in net.state_dict().items():
        if name.endswith("num_batches_tracked"):
            state[name] = tensor
            continue
        k, transposed = key(name, dense)
        value = params[k] if k in params else buffers[k]
        value = value.T if transposed else value
        assert tuple(value.shape) == tuple(tensor.shape), (name, value.shape, tensor.shape)
        state[name] = torch.tensor(np.ascontiguousarray(value))
    net.load_state_dict(state)


def torch_grads(net: nn.Module, dense=()) -> dict:
    """{deepgen name: gradient as numpy}."""
    out = {}
    for name, p in net.named_parameters():
        k, transposed = key(name, dense)
        out[k] = p.grad.numpy().T if transposed else p.grad.numpy()
    return out
