"""Layer graphs of any model ``torch.export`` can trace.

``trace`` exports the model; ``LayerGraph`` groups the exported nodes into layers at module
boundaries, tracks the tensors that cross every boundary (skip connections included) and builds
the ``GraphModule`` of any contiguous range of layers, with the model's own parameter names.
"""

from pipedream.graph.layers import LayerGraph, StageIO
from pipedream.graph.trace import TraceError, trace_model

__all__ = ["LayerGraph", "StageIO", "TraceError", "trace_model"]
