"""The profiler: measures every layer of a workload and writes a profile YAML.

``measure`` times each child of an ``nn.Sequential`` (forward, backward) and counts its bytes
(output, parameters, activations kept for backward, optimizer state); ``command`` is the
``pipedream profile`` verb; ``pipedream_import`` reads graphs of the original PipeDream profiler.
Submodules are imported on demand, so importing this package does not import torch.
"""

__all__: list[str] = []
