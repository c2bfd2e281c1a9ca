"""Moving traced stage modules to a device, the tensors their graphs create included.

``torch.export`` records the device of every tensor a model creates as it runs
(``torch.arange(n, device=x.device)`` becomes ``aten.arange(..., device=cpu)`` when the model
was traced on the CPU: Hugging Face models make their position ids so). ``module.to(device)``
moves parameters and buffers but leaves those constants, so a stage traced on the CPU and run
on a GPU would index a GPU embedding with CPU positions. :func:`place_module` moves the module
and rewrites every device its graphs name to the stage's device: a stage's tensors live where
the stage runs, as they do when the eager model is moved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

__all__ = ["place_module"]


def place_module(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)``, with every ``fx.GraphModule`` inside it creating its tensors on
    ``device`` (each graph that named another device is recompiled)."""
    module = module.to(device)
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule) and _retarget(sub.graph, device):
            sub.recompile()
    return module


def _retarget(graph: fx.Graph, device: torch.device) -> bool:
    """Replace every ``torch.device`` in the arguments of ``graph``'s nodes by ``device``;
    whether any was another device."""
    changed = False

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value != device:
            changed = True
            return device
        return value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return changed
