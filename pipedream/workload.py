"""The workload contract (docs/architecture.md, "Workloads") and how workloads are found by name.

A workload is named by a built-in name (``mlp``, ``gpt``, ``digits``, ``resnet``, ``sleep``,
``hf-lm``) or by ``package.module:function``. The factory takes keyword options
(``--workload-arg key=value``, converted to the types of its signature) and returns a
:class:`Workload`, or a Hugging Face ``transformers`` causal language model, which is then
trained as ``hf-lm`` trains its own (:func:`pipedream.workloads.hf_lm.wrap`, which takes the
options the factory does not).
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pipedream.errors import WorkloadError
from pipedream.formats.units import format_bytes
from pipedream.workload_options import (
    BUILTIN_WORKLOADS,
    Signature,
    absolute_paths,
    check_required,
    import_error,
    key_value_problem,
    keyword_args,
    missing_function,
    runtime_signature,
    split_target,
    unknown_option,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "Workload",
    "load_model",
    "load_workload",
    "parse_workload_args",
    "recorded_args",
]


@dataclass
class Workload:
    """Everything the profiler and the runtime need to know about a training job."""

    model: nn.Module
    """``nn.Sequential`` (layers = its children) or any module ``torch.export`` can trace."""
    example_input: Any
    """One microbatch of input, used for tracing and profiling: a tensor, a tuple of tensors
    (the model's positional arguments) or a dict of tensors (its keyword arguments, such as
    ``input_ids`` and ``attention_mask``)."""
    loss_fn: Callable[[Any, Any], Tensor]
    """(output, target) -> mean loss over the microbatch; ``output`` is what the model returns
    (a tensor, a tuple, a ``ModelOutput``)."""
    dataset: Dataset[tuple[Any, Any]]
    """Items ``(input, target)``, each input of ``example_input``'s structure without the batch
    dimension; the runtime draws them in a seeded deterministic order."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer for a set of parameters (one stage's, or the whole model's)."""
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    """Optional: metrics of a full trained model on held-out data (e.g. test accuracy)."""
    lr_schedule: Callable[[int], float] | None = None
    """Optional: minibatch index ``t`` (from 0, over the whole run) -> factor of every
    parameter group's learning rate at the update that applies minibatch ``t``, as a plain
    loop's ``LambdaLR(optimizer, lr_schedule)`` stepped once per minibatch
    (:mod:`pipedream.runtime.lr_schedule`; warm-up and decay: ``workloads.common.warmup_decay``)."""
    description: str = ""
    """One line for humans."""


def parse_workload_args(pairs: Iterable[str]) -> dict[str, str]:
    """Parse ``KEY=VALUE`` strings from ``--workload-arg``."""
    out: dict[str, str] = {}
    for pair in pairs:
        problem = key_value_problem(pair)
        if problem is not None:
            raise WorkloadError(f"--workload-arg {problem}")
        key, _, value = pair.partition("=")
        out[key.strip()] = value.strip()
    return out


def _resolve_factory(name: str, *, source: str | None = None) -> Callable[..., Workload]:
    module_name, attr = split_target(name, source=source)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadError(import_error(name, module_name, exc, source)) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(missing_function(name, module_name, attr, source))
    return factory  # type: ignore[no-any-return]


def _allocation_failure(exc: BaseException) -> str | None:
    """What an allocator's failure says, in short (None: ``exc`` is not one)."""
    if isinstance(exc, MemoryError):
        return "Python ran out of memory"
    text = str(exc)
    if "can't allocate memory" not in text and "out of memory" not in text.lower():
        return None
    tried = re.search(r"tried to allocate (\d+) bytes", text)
    if tried:
        return f"it tried to allocate {format_bytes(int(tried.group(1)))} at once"
    return text.strip().splitlines()[0]


def load_workload(
    name: str,
    args: Mapping[str, str] | None = None,
    *,
    microbatch_size: int | None = None,
    source: str | None = None,
) -> Workload:
    """Build the workload ``name`` with string options ``args`` converted to the factory's types.

    ``microbatch_size`` is passed to factories that accept it, so that ``example_input`` has the
    microbatch size of the plan or profile. ``source`` names the file the name and options come
    from (a plan): errors then name that file and its ``workload``/``workload_args.KEY`` field
    instead of the ``--workload-arg`` option.
    """
    built, rest, signature = _build(name, args, microbatch_size=microbatch_size, source=source)
    if _is_language_model(built):
        from pipedream.workloads.hf_lm import wrap  # a transformers causal LM

        extra = _wrap_options(signature, rest, name=name, source=source)
        if microbatch_size is not None:
            extra["microbatch_size"] = microbatch_size
        return wrap(built, **extra)
    if rest:
        unknown_option(signature, next(iter(rest)), name=name, source=source)
    return _checked(name, built)


def load_model(
    name: str,
    args: Mapping[str, str] | None = None,
    *,
    microbatch_size: int | None = None,
    source: str | None = None,
) -> nn.Module:
    """The model of workload ``name``: what its factory builds, without the data around a
    ``transformers`` model that a function returns (``pipedream export --hf`` needs no more).
    Options and their checks are :func:`load_workload`'s."""
    built, rest, signature = _build(name, args, microbatch_size=microbatch_size, source=source)
    if _is_language_model(built):
        _wrap_options(signature, rest, name=name, source=source)  # known, though not used
        return built
    if rest:
        unknown_option(signature, next(iter(rest)), name=name, source=source)
    return _checked(name, built).model


def _wrap_options(
    signature: Signature, rest: dict[str, str], *, name: str, source: str | None
) -> dict[str, Any]:
    """The options a factory returning a ``transformers`` model left to :func:`wrap`,
    converted; one it does not take either is refused as the factory's unknown option."""
    from pipedream.workloads.hf_lm import wrap

    wrap_signature = runtime_signature(wrap).drop_first()
    extra, unknown = keyword_args(wrap_signature, rest, name=name, source=source)
    if unknown:
        unknown_option(signature, next(iter(unknown)), name=name, source=source)
    return extra


def _build(
    name: str, args: Mapping[str, str] | None, *, microbatch_size: int | None, source: str | None
) -> tuple[Any, dict[str, str], Signature]:
    """What the factory of ``name`` returns for ``args``, the options it does not take (for
    :func:`wrap`), and its signature."""
    factory = _resolve_factory(name, source=source)
    signature = runtime_signature(factory)
    kwargs, rest = keyword_args(signature, args or {}, name=name, source=source)
    takes_size = "microbatch_size" in signature.names or signature.accepts_any
    if microbatch_size is not None and takes_size:
        kwargs["microbatch_size"] = microbatch_size
    check_required(signature, kwargs, name=name, source=source)
    try:
        built = factory(**kwargs)
    except (MemoryError, RuntimeError) as exc:
        reason = _allocation_failure(exc)
        if reason is None:
            raise
        given = ", ".join(f"{key}={value}" for key, value in kwargs.items())
        raise WorkloadError(
            f"workload {name!r} ({given}) does not fit in memory: {reason}; choose smaller sizes"
        ) from None
    _refuse_compiled(name, built)
    return built, rest, signature


def _refuse_compiled(name: str, built: Any) -> None:
    """A model compiled by ``torch.compile`` (wrapped, or in place by ``model.compile()``) is
    refused, and so is a compiled module inside a model that is traced: pipedream runs each
    stage as traced, so the compilation would be dropped without a word (and the profile would
    time it, the layers of a wrapper named ``_orig_mod.*``). The children of an ``nn.Sequential``
    run as given, so they may be compiled."""
    model = built.model if isinstance(built, Workload) else built
    if not isinstance(model, nn.Module):
        return
    traced = not isinstance(model, nn.Sequential)
    for path, module in model.named_modules() if traced else [("", model)]:
        if _compiled(module):
            what = "the model" if not path else f"module {path!r} of the model"
            raise WorkloadError(
                f"workload {name!r}: {what} is compiled (torch.compile), which pipedream would "
                "drop: it traces the model and runs each stage as traced; return it uncompiled "
                "(not torch.compile(model) or model.compile()); only the children of an "
                "nn.Sequential may be compiled, as they run as given"
            )


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by ``torch.compile`` or compiled in place."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by any torch.compile call
    wrapped = eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)
    return wrapped or getattr(module, "_compiled_call_impl", None) is not None


def _is_language_model(built: Any) -> bool:
    """Whether a factory returned a ``transformers`` causal LM rather than a Workload."""
    return isinstance(built, nn.Module) and hasattr(getattr(built, "config", None), "vocab_size")


def _checked(name: str, built: Any) -> Workload:
    if not isinstance(built, Workload):
        raise WorkloadError(
            f"workload {name!r}: factory returned {type(built).__name__}, expected "
            "pipedream.workload.Workload (or a transformers causal language model)"
        )
    model = built.model
    if isinstance(model, nn.Module) and any(map(is_transformers_model, model.modules())):
        from pipedream.workloads.hf_lm import _transformers

        _transformers()  # refuses a release pipedream does not take
    return built


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model (a ``PreTrainedModel``). Read from the
    modules already imported: asking ``transformers`` for the class would import its modeling
    code, 2 s of a process that trains no such model."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def recorded_args(name: str, args: Mapping[str, str]) -> dict[str, str]:
    """The options of workload ``name`` as a profile records them: a relative file path (the
    ``tokens`` of ``hf-lm`` and of a wrapped ``transformers`` model) made absolute against the
    current directory, where the user wrote it; the plan made from the profile then trains on
    the same file from any directory (:func:`~pipedream.workload_options.absolute_paths`)."""
    return absolute_paths(name, runtime_signature(_resolve_factory(name)), args)
