"""torchvision for the import tests: its `_C` extension does not load beside a CPU-only torch
build, and torchvision registers fake kernels for `torchvision::nms` / `qnms` at import, which
need the schemas; this defines them (once) before importing torchvision. None when torchvision
is not installed."""

from __future__ import annotations

_LIB = None


def torchvision():
    """The torchvision module, or None when it is not installed."""
    global _LIB
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return None
    import torch

    if _LIB is None:
        try:
            torch.ops.torchvision.nms.default  # the real extension loaded: nothing to define
        except (AttributeError, RuntimeError):
            _LIB = torch.library.Library("torchvision", "DEF")
            _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision as tv

    return tv


def classification_models() -> list[str]:
    """Every classification model torchvision lists (alexnet ... wide_resnet101_2)."""
    tv = torchvision()
    return sorted(tv.models.list_models(module=tv.models)) if tv else []
