"""A workload's name and ``KEY=VALUE`` options, checked against its factory's signature.

The signature is read in one of two ways. :func:`runtime_signature` asks ``inspect`` of the
imported factory (what :func:`pipedream.workload.load_workload` uses before calling it).
:func:`source_signature` reads the factory's ``def`` in its module's source with ``ast``,
importing nothing but the packages above the module. ``launch.sh`` uses it through
:func:`check_workload`, to refuse a plan's unknown workload, missing module, unknown option or
badly typed value in one line before any process starts, without the seconds of importing torch
that every rank pays again.

Both ways give the same :class:`Signature`, and :func:`keyword_args` converts the options with
it. Where the source leaves a question open (a decorated factory, a name bound twice, a module
without Python source), :func:`source_signature` gives up and the ranks check.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream.errors import WorkloadError

__all__ = [
    "BUILTIN_WORKLOADS",
    "IMPORTED",
    "PATH_OPTIONS",
    "WRAP",
    "Signature",
    "absolute_paths",
    "check_required",
    "check_workload",
    "convert",
    "import_error",
    "key_value_problem",
    "keyword_args",
    "missing_function",
    "runtime_signature",
    "source_signature",
    "split_target",
    "unknown_option",
    "where",
]

BUILTIN_WORKLOADS: dict[str, str] = {
    "mlp": "pipedream.workloads.mlp:build",
    "gpt": "pipedream.workloads.gpt:build",
    "digits": "pipedream.workloads.digits:build",
    "resnet": "pipedream.workloads.resnet:build",
    "sleep": "pipedream.workloads.sleep:build",
    "hf-lm": "pipedream.workloads.hf_lm:build",
}
"""Built-in workload names and the factories they stand for."""

IMPORTED = "pipedream-import"
"""``IMPORTED:NAME`` is the workload of a profile converted from the original PipeDream's
``graph.txt``: there is no model to train."""

WRAP = "pipedream.workloads.hf_lm:wrap"
"""What trains a factory's ``transformers`` model; it takes the options the factory does not."""

PATH_OPTIONS: dict[str, tuple[str, ...]] = {
    "pipedream.workloads.hf_lm:build": ("tokens", "pretrained"),
    WRAP: ("tokens",),
}
"""The options that name a file, by factory (:func:`absolute_paths`)."""

_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


@dataclass(frozen=True)
class Signature:
    """The keyword options a factory takes, in order, and the type each value converts to."""

    names: tuple[str, ...]
    kinds: Mapping[str, type | None]
    """``int``, ``float`` or ``bool`` where the value is converted; ``None`` (or ``str``): the
    string is passed as it is."""
    accepts_any: bool
    """The factory has ``**kwargs``: every key is an option, passed as a string."""
    required: tuple[str, ...] = ()
    """The options without a default, which every call must give."""

    def drop_first(self) -> Signature:
        """Without the first parameter (``wrap``'s model, which is no option)."""
        first = self.names[:1]
        required = tuple(name for name in self.required if name not in first)
        return Signature(self.names[1:], self.kinds, self.accepts_any, required)


def where(source: str | None, field: str) -> str:
    """``"FILE: FIELD: "`` when the workload comes from a file (a plan), else nothing."""
    return f"{source}: {field}: " if source else ""


def split_target(name: str, *, source: str | None = None) -> tuple[str, str]:
    """``(module, function)`` that the workload ``name`` stands for."""
    if name.startswith(IMPORTED + ":"):
        raise WorkloadError(
            f"{where(source, 'workload')}{name!r} is the workload of a profile imported from "
            "PipeDream's graph.txt, which can be planned and simulated but not trained; profile "
            "your model with `pipedream profile WORKLOAD` and plan that profile to train it"
        )
    module_name, sep, attr = BUILTIN_WORKLOADS.get(name, name).partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(
            f"{where(source, 'workload')}unknown workload {name!r}; use a built-in name "
            f"({', '.join(BUILTIN_WORKLOADS)}) or package.module:function"
        )
    return module_name, attr


def import_error(name: str, module_name: str, exc: BaseException, source: str | None) -> str:
    """The message for a workload whose module cannot be imported."""
    return (
        f"{where(source, 'workload')}workload {name!r}: cannot import module {module_name!r} "
        f"({exc}); check the name and that the module is on PYTHONPATH"
    )


def missing_function(name: str, module_name: str, attr: str, source: str | None) -> str:
    """The message for a workload whose module lacks the function."""
    return (
        f"{where(source, 'workload')}workload {name!r}: module {module_name!r} has no "
        f"function {attr!r}; check the name after the colon"
    )


def runtime_signature(function: Callable[..., Any]) -> Signature:
    """The signature of an imported factory, as ``inspect`` reports it."""
    names: list[str] = []
    kinds: dict[str, type | None] = {}
    required: list[str] = []
    accepts_any = False
    for param in inspect.signature(function).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            accepts_any = True
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        names.append(param.name)
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        annotation = param.annotation
        if annotation is inspect.Parameter.empty:
            has_default = param.default is not inspect.Parameter.empty
            kinds[param.name] = type(param.default) if has_default else None
        elif isinstance(annotation, str):  # ``from __future__ import annotations``
            kinds[param.name] = _KINDS.get(annotation.removesuffix(" | None"))
        else:  # ``int | None`` unpostponed is no type: its value is passed as a string
            kinds[param.name] = annotation if isinstance(annotation, type) else None
    return Signature(tuple(names), kinds, accepts_any, tuple(required))


def source_signature(module_name: str, attr: str) -> Signature | None:
    """The signature of ``module_name.attr`` read from its source without importing it.

    Raises ``ImportError`` where the module does not exist (packages above it are imported to
    find it) and ``AttributeError`` where its source never names ``attr``. ``None`` where the
    source does not settle the signature: no Python source, a package above that fails to
    import here (it may need the ranks' environment), a ``def`` that is decorated or not at
    the top level, the name bound more than once or perhaps elsewhere (a star import, a
    ``global`` statement, the name as a string, a ``__signature__``).
    """
    try:
        spec = importlib.util.find_spec(module_name)
    except ImportError:
        raise
    except Exception:  # a package's __init__ failed: perhaps only outside torchrun
        return None
    if spec is None:
        raise ModuleNotFoundError(f"No module named {module_name!r}")
    if spec.origin is None or not spec.origin.endswith(".py"):
        return None
    try:
        text = importlib.util.decode_source(Path(spec.origin).read_bytes())
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None  # the import in the ranks says what is wrong
    postponed = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    bound = [_bound_names(node) for node in tree.body]
    if any("*" in names for names in bound) or _bound_dynamically(tree, attr, text):
        return None
    bindings = [node for node, names in zip(tree.body, bound, strict=True) if attr in names]
    if not bindings:
        dynamic = any("__getattr__" in names for names in bound)
        if attr not in text and not dynamic:  # not even a string could make it
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        return None
    if len(bindings) != 1 or not isinstance(bindings[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    function = bindings[0]
    if function.decorator_list:
        return None
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
    defaults += arguments.defaults
    defaults += arguments.kw_defaults
    names: list[str] = []
    kinds: dict[str, type | None] = {}
    parameters = [*positional, *arguments.kwonlyargs]
    shadowed = set().union(*bound) & _KINDS.keys()  # ``int`` etc. bound by the module
    for arg, default in zip(parameters, defaults, strict=True):
        names.append(arg.arg)
        kinds[arg.arg] = _source_kind(arg.annotation, default, postponed, shadowed)
    required = tuple(arg.arg for arg, default in zip(parameters, defaults) if default is None)
    return Signature(tuple(names), kinds, arguments.kwarg is not None, required)


def _bound_dynamically(tree: ast.Module, attr: str, text: str) -> bool:
    """Whether ``attr`` may be rebound where :func:`_bound_names` does not look: a function's
    ``global attr``, the name as a string (``globals()["build"] = ...``, ``setattr``; the
    strings of ``__all__`` aside), or a signature set by hand."""
    if "__signature__" in text:
        return True
    listed = {
        id(node)
        for statement in tree.body
        if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign)
        and "__all__" in _bound_names(statement)
        for node in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Global) and attr in node.names:
            return True
        if isinstance(node, ast.Constant) and node.value == attr and id(node) not in listed:
            return True
    return False


def _bound_names(statement: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds or deletes (``"*"``: any name).

    Looks into ``if``/``try``/``for``/``with`` blocks but not into the bodies of functions and
    classes, whose names are their own.
    """
    names: set[str] = set()
    todo: list[ast.AST] = [statement]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif not isinstance(node, ast.Lambda):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                names.add(node.id)
            todo.extend(ast.iter_child_nodes(node))
    return names


def _source_kind(
    annotation: ast.expr | None, default: ast.expr | None, postponed: bool, shadowed: set[str]
) -> type | None:
    """What :func:`runtime_signature` would find for one parameter, from its source."""
    if annotation is None:
        if default is None:
            return None
        try:
            return type(ast.literal_eval(default))
        except ValueError:
            return None  # a default that is no literal: the ranks convert the value
    if postponed:  # the annotation is the compiler's text of it ("int | None")
        return _KINDS.get(ast.unparse(annotation).removesuffix(" | None"))
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _KINDS.get(annotation.value.removesuffix(" | None"))
    if isinstance(annotation, ast.Name) and annotation.id not in shadowed:  # a builtin type
        return _KINDS.get(annotation.id)
    return None


_CONVERT_FIX: dict[Any, str] = {
    int: "write a whole number such as 8",
    float: "write a number such as 0.05",
    bool: "write true or false",
}


def convert(
    value: str, kind: type | None, *, key: str, workload: str, source: str | None = None
) -> Any:
    """The option ``key=value`` as the factory takes it: an int, float or bool where ``kind`` is
    one, else the string."""
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
                f"{where(source, f'workload_args.{key}')}{value!r} is not a valid {kind_name} "
                f"for workload {workload!r}; {fix}"
            ) from None
        raise WorkloadError(
            f"workload {workload!r}: --workload-arg {key}={value!r} is not a valid {kind_name}; "
            f"{fix}"
        ) from None
    return value


def keyword_args(
    signature: Signature, args: Mapping[str, str], *, name: str, source: str | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The options ``signature`` takes, converted to its types, and the rest (as given)."""
    kwargs: dict[str, Any] = {}
    rest: dict[str, str] = {}
    for key, value in args.items():
        if key not in signature.names and not signature.accepts_any:
            rest[key] = value
            continue
        kind = signature.kinds.get(key)
        kwargs[key] = convert(value, kind, key=key, workload=name, source=source)
    return kwargs, rest


def check_required(
    signature: Signature, given: Collection[str], *, name: str, source: str | None
) -> None:
    """Refuse a call that leaves out an option without a default."""
    missing = [option for option in signature.required if option not in given]
    if missing:
        fix = "add it to workload_args" if source else f"give --workload-arg {missing[0]}=VALUE"
        if missing[0] == "microbatch_size" and not source:
            fix = "give --microbatch-size B"
        raise WorkloadError(
            f"{where(source, 'workload_args')}workload {name!r} needs "
            f"{', '.join(repr(option) for option in missing)}, which has no default; {fix}"
        )


def key_value_problem(pair: str) -> str | None:
    """What is wrong with a ``--workload-arg`` value (``'layers' is not KEY=VALUE; ...``), or
    None where it is ``KEY=VALUE`` with a key: the one rule, for the command line's parser and
    for :func:`~pipedream.workload.parse_workload_args`."""
    key, sep, _ = pair.partition("=")
    if sep and key.strip():
        return None
    return f"{pair!r} is not KEY=VALUE; write e.g. --workload-arg layers=8"


def unknown_option(signature: Signature, key: str, *, name: str, source: str | None) -> None:
    """Raise the error for an option ``key`` that the factory ``name`` does not take."""
    names = [p for p in signature.names if p != "microbatch_size"]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise WorkloadError(
        f"{where(source, f'workload_args.{key}')}workload {name!r} has no option "
        f"{key!r}{hint}; its options are: {', '.join(names) or 'none'}"
    )


def check_workload(
    name: str, args: Mapping[str, str] | None = None, *, source: str | None = None
) -> None:
    """Refuse what :func:`~pipedream.workload.load_workload` would refuse before calling the
    factory (an unknown name, a module or function that is not there, an unknown option, a
    value of the wrong type), without importing the factory's module or torch.

    An option the factory lacks passes if ``hf_lm.wrap`` takes it, since a factory may return
    a ``transformers`` model. Whatever the source leaves open, and the checks a factory makes
    itself, are left to the ranks.
    """
    module_name, attr = split_target(name, source=source)
    try:
        signature = source_signature(module_name, attr)
    except (ImportError, ValueError) as exc:
        raise WorkloadError(import_error(name, module_name, exc, source)) from None
    except AttributeError:
        raise WorkloadError(missing_function(name, module_name, attr, source)) from None
    if signature is None:
        return
    given, rest = keyword_args(signature, args or {}, name=name, source=source)
    check_required(signature, [*given, "microbatch_size"], name=name, source=source)
    if not rest:
        return
    wrap = source_signature(*split_target(WRAP))
    assert wrap is not None, "hf_lm.wrap is a plain top-level def"
    _, unknown = keyword_args(wrap.drop_first(), rest, name=name, source=source)
    if unknown:
        unknown_option(signature, next(iter(unknown)), name=name, source=source)


def absolute_paths(name: str, signature: Signature, args: Mapping[str, str]) -> dict[str, str]:
    """``args`` with the relative file paths among them made absolute, against the current
    directory: what ``pipedream profile`` records, so that the plans made from its profile read
    the same files wherever they are launched.

    The paths are the :data:`PATH_OPTIONS` of ``name``'s factory (``signature``), and those of
    :data:`WRAP` that the factory leaves to it. Other options are kept as they are.
    """
    paths = set(PATH_OPTIONS.get(BUILTIN_WORKLOADS.get(name, name), ()))
    if not signature.accepts_any:
        paths |= {key for key in PATH_OPTIONS[WRAP] if key not in signature.names}
    out = dict(args)
    for key in paths & out.keys():
        if out[key] and not Path(out[key]).is_absolute():
            out[key] = str(Path.cwd() / out[key])
    return out
