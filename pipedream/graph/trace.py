"""Exporting a workload's model with ``torch.export``, with errors a user can act on."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from pipedream.errors import WorkloadError
from pipedream.model_io import model_args

__all__ = ["TraceError", "trace_model"]


class TraceError(WorkloadError):
    """``torch.export`` could not trace the model."""


def trace_model(model: nn.Module, example_input: Any) -> ExportedProgram:
    """Export ``model`` on one microbatch (non-strict, training IR, parameters lifted).

    ``example_input`` is a tensor, a tuple of tensors (positional arguments) or a dict of
    tensors (keyword arguments). The graph is specialised to the example's shapes, which is
    what a pipeline needs: every microbatch has the same shape.
    """
    args, kwargs = model_args(example_input)
    chatter = io.StringIO()  # torch.export prints the partial graph when it fails
    try:
        with _quiet_torch_logs(), contextlib.redirect_stdout(chatter):
            with contextlib.redirect_stderr(chatter):
                return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # torch.export raises many types; the user needs one message
        first = " ".join(str(exc).strip().splitlines()[:1])[:300]
        raise TraceError(
            f"torch.export could not trace {type(model).__name__} ({type(exc).__name__}: "
            f"{first}); make its forward traceable (no data-dependent Python control flow, "
            "tensors in and out; a Hugging Face model with use_cache=False), or express the "
            "model as an nn.Sequential of layers, which pipedream splits without tracing"
        ) from None


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's own warnings while tracing (the failure is reported as one line)."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name == "torch" or name.startswith("torch.")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
