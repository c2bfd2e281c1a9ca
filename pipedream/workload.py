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
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pipedream.errors import WorkloadError

__all__ = ["BUILTIN_WORKLOADS", "Workload", "load_workload", "parse_workload_args"]

BUILTIN_WORKLOADS: dict[str, str] = {
    "mlp": "pipedream.workloads.mlp:build",
    "gpt": "pipedream.workloads.gpt:build",
    "digits": "pipedream.workloads.digits:build",
    "resnet": "pipedream.workloads.resnet:build",
    "sleep": "pipedream.workloads.sleep:build",
    "hf-lm": "pipedream.workloads.hf_lm:build",
}
"""Built-in workload names and the factories they stand for."""


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
    description: str = ""
    """One line for humans."""


def parse_workload_args(pairs: Iterable[str]) -> dict[str, str]:
    """Parse ``KEY=VALUE`` strings from ``--workload-arg``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(
                f"--workload-arg {pair!r} is not KEY=VALUE; write e.g. --workload-arg layers=8"
            )
        out[key.strip()] = value.strip()
    return out


def _where(source: str | None, field: str) -> str:
    """``"FILE: FIELD: "`` when the workload comes from a file (a plan), else nothing."""
    return f"{source}: {field}: " if source else ""


def _resolve_factory(name: str, *, source: str | None = None) -> Callable[..., Workload]:
    where = _where(source, "workload")
    target = BUILTIN_WORKLOADS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(
            f"{where}unknown workload {name!r}; use a built-in name "
            f"({', '.join(BUILTIN_WORKLOADS)}) or package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadError(
            f"{where}workload {name!r}: cannot import module {module_name!r} ({exc}); "
            "check the name and that the module is on PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(
            f"{where}workload {name!r}: module {module_name!r} has no function {attr!r}; "
            "check the name after the colon"
        )
    return factory  # type: ignore[no-any-return]


_CONVERT_FIX: dict[Any, str] = {
    int: "write a whole number such as 8",
    float: "write a number such as 0.05",
    bool: "write true or false",
}


def _convert(
    value: str, annotation: Any, *, key: str, workload: str, source: str | None = None
) -> Any:
    kind = annotation if isinstance(annotation, type) else None
    if isinstance(annotation, str):  # ``float | None``: a value given is a float
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(
            annotation.removesuffix(" | None")
        )
    try:
        if kind is bool:
            lowered = value.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind in (int, float):
            return kind(value)
    except ValueError:
        kind_name = kind.__name__ if kind else "value"
        fix = _CONVERT_FIX.get(kind, "check the value")
        if source:
            raise WorkloadError(
                f"{_where(source, f'workload_args.{key}')}{value!r} is not a valid {kind_name} "
                f"for workload {workload!r}; {fix}"
            ) from None
        raise WorkloadError(
            f"workload {workload!r}: --workload-arg {key}={value!r} is not a valid {kind_name}; "
            f"{fix}"
        ) from None
    return value


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
    factory = _resolve_factory(name, source=source)
    kwargs, rest = _keyword_args(factory, args or {}, name=name, source=source)
    params = inspect.signature(factory).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if microbatch_size is not None and ("microbatch_size" in params or accepts_any):
        kwargs["microbatch_size"] = microbatch_size
    workload = factory(**kwargs)
    if isinstance(workload, nn.Module) and hasattr(getattr(workload, "config", None), "vocab_size"):
        from pipedream.workloads.hf_lm import wrap  # a transformers causal LM

        extra, unknown = _keyword_args(wrap, rest, name=name, source=source, model=True)
        if unknown:
            _unknown_option(factory, next(iter(unknown)), name=name, source=source)
        if microbatch_size is not None:
            extra["microbatch_size"] = microbatch_size
        return wrap(workload, **extra)
    if rest:
        _unknown_option(factory, next(iter(rest)), name=name, source=source)
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload {name!r}: factory returned {type(workload).__name__}, expected "
            "pipedream.workload.Workload (or a transformers causal language model)"
        )
    return workload


def _keyword_args(
    function: Callable[..., Any],
    args: Mapping[str, str],
    *,
    name: str,
    source: str | None,
    model: bool = False,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The options ``function`` takes, converted to the types of its signature, and the rest.

    ``model``: ``function`` is :func:`~pipedream.workloads.hf_lm.wrap`, whose first argument
    (the model) is no option.
    """
    params = dict(inspect.signature(function).parameters)
    if model:
        params.pop(next(iter(params)))
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    rest: dict[str, str] = {}
    for key, value in args.items():
        if key not in params and not accepts_any:
            rest[key] = value
            continue
        annotation = params[key].annotation if key in params else str
        if annotation is inspect.Parameter.empty and key in params:
            default = params[key].default
            annotation = type(default) if default is not inspect.Parameter.empty else str
        kwargs[key] = _convert(value, annotation, key=key, workload=name, source=source)
    return kwargs, rest


def _unknown_option(
    factory: Callable[..., Any], key: str, *, name: str, source: str | None
) -> None:
    params = inspect.signature(factory).parameters
    known = ", ".join(p for p in params if p != "microbatch_size") or "none"
    raise WorkloadError(
        f"{_where(source, f'workload_args.{key}')}workload {name!r} has no option "
        f"{key!r}; its options are: {known}"
    )
