"""pipedream: PipeDream-style pipeline-parallel training for PyTorch.

Three parts, one workflow: ``pipedream.profiler`` measures every layer of a model,
``pipedream.optimizer`` splits the layers into (replicated) pipeline stages for a cluster, and
``pipedream.runtime`` trains the model with PipeDream's asynchronous 1F1B schedule (and the
synchronous ones) under ``torchrun``.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
