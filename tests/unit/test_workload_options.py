"""A workload's options checked from its factory's source (``launch.sh``'s check, no imports)
agree with the check of the imported factory (every rank's), and give up where the source
leaves the signature open."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

from pipedream.errors import WorkloadError
from pipedream.workload import load_workload
from pipedream.workload_options import (
    BUILTIN_WORKLOADS,
    WRAP,
    Signature,
    check_workload,
    runtime_signature,
    source_signature,
    split_target,
)


@pytest.mark.parametrize("target", [*BUILTIN_WORKLOADS.values(), WRAP])
def test_the_source_gives_each_built_in_factory_the_signature_inspect_gives(target: str) -> None:
    module_name, attr = target.split(":")
    imported = getattr(importlib.import_module(module_name), attr)
    assert source_signature(module_name, attr) == runtime_signature(imported)


POSTPONED = """
from __future__ import annotations

def build(layers: int = 2, scale: float = 1.0, tie: bool = True, name: str = "a",
          limit: int | None = None, packed: int|None = None, quoted: "int" = 3,
          plain=4, *, seed: int = 0, **extra) -> object:
    return None
"""

UNPOSTPONED = """
import typing

DEFAULT = 4

def build(layers: int = 2, limit: int | None = None, maybe: typing.Optional[int] = None,
          quoted: "float" = 1.0, default=DEFAULT, literal=0.5, flag=False, none=None, bare=None,
          /, *rest) -> object:
    return None
"""


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


def test_postponed_annotations_are_read_as_the_compiler_writes_them(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "wl_postponed", POSTPONED)
    signature = source_signature(name, "build")
    assert signature == Signature(
        names=("layers", "scale", "tie", "name", "limit", "packed", "quoted", "plain", "seed"),
        kinds={
            "layers": int,
            "scale": float,
            "tie": bool,
            "name": str,
            "limit": int,
            "packed": int,  # the compiler writes "int | None"
            "quoted": None,  # the compiler writes "'int'"
            "plain": int,
            "seed": int,
        },
        accepts_any=True,
    )
    assert signature == runtime_signature(importlib.import_module(name).build)


def test_unpostponed_annotations_convert_only_builtin_types(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "wl_unpostponed", UNPOSTPONED)
    signature = source_signature(name, "build")
    kinds = {
        "layers": int,
        "limit": None,  # a union is no type: the value stays a string
        "maybe": None,
        "quoted": float,
        "default": None,  # inspect sees int; the source cannot tell, so the ranks convert
        "literal": float,
        "flag": bool,
        "none": type(None),
        "bare": type(None),
    }
    assert signature == Signature(tuple(kinds), kinds, accepts_any=False)
    imported = runtime_signature(importlib.import_module(name).build)
    assert imported == Signature(tuple(kinds), {**kinds, "default": int}, accepts_any=False)


@pytest.mark.parametrize(
    "source",
    [
        "def deco(f):\n    return f\n\n@deco\ndef build(layers: int = 2): ...\n",
        "def build(layers: int = 2): ...\n\nbuild = print\n",
        "def build(layers=2): ...\n\ndef install():\n    global build\n    build = print\n",
        "def build(layers=2): ...\n\nglobals()['build'] = print\n",
        "def build(layers=2): ...\n\nbuild.__signature__ = None\n",
        "import sys\nif sys.platform:\n    def build(layers: int = 2): ...\n",
        "from os.path import *\n\ndef build(layers: int = 2): ...\n",
        "def __getattr__(name): ...\n",
        "__all__ = ['build']\n",  # named, never bound: perhaps through globals()
        "build = lambda layers=2: None\n",
    ],
    ids=[
        "decorated",
        "rebound",
        "global",
        "string",
        "signature",
        "nested",
        "star",
        "getattr",
        "named",
        "lambda",
    ],
)
def test_the_source_gives_up_where_it_leaves_the_signature_open(
    tmp_path, monkeypatch, source: str
) -> None:
    name = _module(tmp_path, monkeypatch, "wl_open", source)
    assert source_signature(name, "build") is None


def test_options_without_a_default_are_required(tmp_path, monkeypatch) -> None:
    source = "def build(path, /, size: int, *, seed: int, mode='a', **extra): ...\n"
    name = _module(tmp_path, monkeypatch, "wl_required", source)
    signature = source_signature(name, "build")
    assert signature is not None and signature.required == ("path", "size", "seed")
    assert signature == runtime_signature(importlib.import_module(name).build)
    with pytest.raises(WorkloadError) as refused:
        check_workload(f"{name}:build", {"path": "p", "size": "3"}, source="plan.yaml")
    assert str(refused.value) == (
        "plan.yaml: workload_args: workload 'wl_required:build' needs 'seed', which has no "
        "default; add it to workload_args"
    )
    check_workload(f"{name}:build", {"path": "p", "size": "3", "seed": "1"})
    sized = _module(tmp_path, monkeypatch, "wl_sized", "def build(microbatch_size): ...\n")
    with pytest.raises(WorkloadError) as refused:
        load_workload(f"{sized}:build")
    assert str(refused.value) == (
        "workload 'wl_sized:build' needs 'microbatch_size', which has no default; give "
        "--microbatch-size B"
    )


def test_the_names_in_all_do_not_leave_the_signature_open(tmp_path, monkeypatch) -> None:
    source = "__all__ = ['build']\n\ndef build(layers: int = 2): ...\n"
    name = _module(tmp_path, monkeypatch, "wl_all", source)
    assert source_signature(name, "build") == Signature(("layers",), {"layers": int}, False)


def test_a_builtin_type_the_module_rebinds_converts_nothing(tmp_path, monkeypatch) -> None:
    source = "from fractions import Fraction as float\n\ndef build(scale: float = 1): ...\n"
    name = _module(tmp_path, monkeypatch, "wl_shadow", source)
    assert source_signature(name, "build") == Signature(("scale",), {"scale": None}, False)
    check_workload(f"{name}:build", {"scale": "1/3"})  # a Fraction, not a float


def test_a_package_that_imports_only_under_torchrun_is_left_to_the_ranks(
    tmp_path, monkeypatch
) -> None:
    """Its __init__ read LOCAL_RANK: the check raised KeyError and launch.sh stopped."""
    package = tmp_path / "wl_ranked"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nLOCAL_RANK = int(os.environ['LOCAL_RANK'])\n")
    (package / "models.py").write_text("def build(layers: int = 2): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    importlib.invalidate_caches()
    assert source_signature("wl_ranked.models", "build") is None
    check_workload("wl_ranked.models:build", {"layers": "3"})


def test_a_function_the_source_never_names_is_missing(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "wl_missing", "def make(): ...\n")
    with pytest.raises(AttributeError):
        source_signature(name, "build")


def test_a_name_only_used_in_a_function_body_does_not_count_as_bound(tmp_path, monkeypatch) -> None:
    source = "def build(layers: int = 2): ...\n\ndef other():\n    build = 1\n    return build\n"
    name = _module(tmp_path, monkeypatch, "wl_local", source)
    assert source_signature(name, "build") == Signature(("layers",), {"layers": int}, False)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("mpl", {}),
        ("no_such_package.module:build", {}),
        ("pipedream.workloads.no_such_module:build", {}),
        ("pipedream.workloads.mlp:no_such_function", {}),
        ("mlp", {"widht": "8"}),
        ("mlp", {"width": "wide"}),
        ("mlp", {"lr": "fast"}),
        ("hf-lm", {"tie": "maybe"}),
        ("gpt", {"colour": "red"}),
        ("pipedream-import:vgg16", {}),
        ("json:loads", {}),  # a TypeError from the call before
        ("json:loads", {"cls": "x"}),
    ],
)
@pytest.mark.parametrize("source", [None, "plan.yaml"])
def test_the_source_check_refuses_what_loading_refuses_with_the_same_words(
    name: str, args: dict[str, str], source: str | None
) -> None:
    with pytest.raises(WorkloadError) as loading:
        load_workload(name, args, source=source)
    with pytest.raises(WorkloadError) as checking:
        check_workload(name, args, source=source)
    assert str(checking.value) == str(loading.value)


def test_options_of_the_wrapper_pass_since_a_factory_may_return_a_transformers_model(
    tmp_path, monkeypatch
) -> None:
    name = _module(tmp_path, monkeypatch, "wl_model", "def model(layers: int = 2): ...\n")
    check_workload(f"{name}:model", {"layers": "3", "seq": "16", "optimizer": "sgd"})
    with pytest.raises(WorkloadError) as refused:
        check_workload(f"{name}:model", {"seq": "long"})
    assert str(refused.value) == (
        "workload 'wl_model:model': --workload-arg seq='long' is not a valid int; "
        "write a whole number such as 8"
    )
    with pytest.raises(WorkloadError) as refused:
        check_workload(f"{name}:model", {"colour": "red"}, source="plan.yaml")
    assert str(refused.value) == (
        "plan.yaml: workload_args.colour: workload 'wl_model:model' has no option 'colour'; "
        "its options are: layers"
    )


def test_an_imported_profiles_workload_says_it_cannot_be_trained() -> None:
    """It said: cannot import module 'pipedream-import'."""
    with pytest.raises(WorkloadError) as refused:
        check_workload("pipedream-import:vgg16", source="plan.yaml")
    assert str(refused.value) == (
        "plan.yaml: workload: 'pipedream-import:vgg16' is the workload of a profile imported "
        "from PipeDream's graph.txt, which can be planned and simulated but not trained; "
        "profile your model with `pipedream profile WORKLOAD` and plan that profile to train it"
    )


def test_valid_options_pass() -> None:
    check_workload("gpt", {"layers": "2", "dim": "32", "lr": "1e-3"})
    check_workload("hf-lm", {"tie": "false", "config": "llama"})
    assert split_target("sleep") == ("pipedream.workloads.sleep", "build")
