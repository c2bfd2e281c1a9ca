"""Workload errors name what to fix: the ``--workload-arg`` option, or a plan's file and field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipedream.errors import PipedreamError, WorkloadError
from pipedream.workload import load_model, load_workload, parse_workload_args


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "nope",
            {},
            "unknown workload 'nope'; use a built-in name (mlp, gpt, digits, resnet, sleep, "
            "hf-lm) or package.module:function",
        ),
        ("no_such_module_xyz:build", {}, "workload 'no_such_module_xyz:build': cannot import"),
        (
            "pipedream.workloads.mlp:nothing",
            {},
            "workload 'pipedream.workloads.mlp:nothing': module 'pipedream.workloads.mlp' has "
            "no function 'nothing'; check the name after the colon",
        ),
        (
            "mlp",
            {"layers": "many"},
            "workload 'mlp': --workload-arg layers='many' is not a valid int; write a whole number",
        ),
        (
            "mlp",
            {"lr": "fast"},
            "workload 'mlp': --workload-arg lr='fast' is not a valid float; write a number",
        ),
        ("mlp", {"colour": "red"}, "workload 'mlp' has no option 'colour'; its options are: "),
        # each of these reached torch or time.sleep, which raised from inside the ranks
        ("mlp", {"lr": "nan"}, "learning rate must be a positive number, got lr=nan; e.g. "),
        ("gpt", {"lr": "inf"}, "learning rate must be a positive number, got lr=inf; e.g. "),
        ("digits", {"momentum": "-0.5"}, "momentum must be in [0, 1), got momentum=-0.5; e.g."),
        ("resnet", {"momentum": "nan"}, "momentum must be in [0, 1), got momentum=nan; e.g."),
        (
            "sleep",
            {"forward_ms": "inf"},
            "sleep: forward_ms and backward_ms must be 0 to 3600000 (an hour), got inf, 20.0",
        ),
        (
            "sleep",
            {"backward_ms": "nan"},
            "sleep: forward_ms and backward_ms must be 0 to 3600000 (an hour), got 10.0, nan",
        ),
        (
            "json:loads",
            {},
            "workload 'json:loads' needs 's', which has no default; give --workload-arg s=VALUE",
        ),
    ],
)
def test_command_line_errors(name: str, args: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload(name, args)
    assert isinstance(info.value, PipedreamError)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("nope", {}, "plan.yaml: workload: unknown workload 'nope'; use a built-in name"),
        ("no_such_module_xyz:f", {}, "plan.yaml: workload: workload 'no_such_module_xyz:f': "),
        (
            "mlp",
            {"layers": "many"},
            "plan.yaml: workload_args.layers: 'many' is not a valid int for workload 'mlp'; "
            "write a whole number such as 8",
        ),
        (
            "mlp",
            {"colour": "red"},
            "plan.yaml: workload_args.colour: workload 'mlp' has no option 'colour'; its "
            "options are: layers, width",
        ),
    ],
)
def test_errors_name_the_plan_file_and_field(name: str, args: dict[str, str], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload(name, args, source="plan.yaml")
    assert str(info.value).startswith(message)
    assert "--workload-arg" not in str(info.value)


@pytest.mark.parametrize("pair", ["layers", "=3", " =3"])
def test_parse_workload_args_rejects(pair: str) -> None:
    with pytest.raises(WorkloadError, match="is not KEY=VALUE; write e.g. --workload-arg"):
        parse_workload_args([pair])


def test_parse_workload_args() -> None:
    assert parse_workload_args(["layers=8", " width = 16 ", "name=a=b"]) == {
        "layers": "8",
        "width": "16",
        "name": "a=b",
    }


def test_a_workload_too_big_for_memory_says_so_in_one_line(tmp_path, monkeypatch) -> None:
    """The allocator's RuntimeError came out as a traceback (e.g. mlp width=1000000000)."""
    (tmp_path / "wl_huge.py").write_text(
        "import torch\n\n"
        "def build(size: int = 2**60):\n"
        "    return torch.empty(size, dtype=torch.uint8)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError) as info:
        load_workload("wl_huge:build", {"size": str(2**60)})
    assert str(info.value) == (
        f"workload 'wl_huge:build' (size={2**60}) does not fit in memory: it tried to allocate "
        "1.0 EiB at once; choose smaller sizes"
    )


def test_other_runtime_errors_of_a_factory_pass_through(tmp_path, monkeypatch) -> None:
    (tmp_path / "wl_broken.py").write_text(
        "def build():\n    raise RuntimeError('a bug in the factory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="a bug in the factory"):
        load_workload("wl_broken:build", {})


COMPILED_FACTORIES = """
import types

import torch
from torch import nn

from pipedream.workloads.mlp import build as make


class Traced(nn.Module):  # not an nn.Sequential: pipedream traces it
    def __init__(self, body):
        super().__init__()
        self.body = body
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.body(x))


def with_model(model):
    built = make()
    built.model = model
    return built


def wrapped():
    return with_model(torch.compile(make().model))


def in_place():
    model = make().model
    model.compile()
    return with_model(model)


def language_model():  # what a transformers model looks like to load_workload: a config
    model = nn.Linear(2, 2)
    model.config = types.SimpleNamespace(vocab_size=2)
    return torch.compile(model)


def traced_wrapped_child():
    return with_model(Traced(torch.compile(nn.Linear(2, 2))))


def traced_child_in_place():
    body = nn.Linear(2, 2)
    body.compile()
    return with_model(Traced(body))


def sequential_wrapped_child():
    model = make().model
    model[0] = torch.compile(model[0])
    return with_model(model)


def sequential_child_in_place():
    model = make().model
    model[0].compile()
    return with_model(model)
"""


@pytest.mark.parametrize(
    ("factory", "what"),
    [
        ("wrapped", "the model"),
        ("in_place", "the model"),
        ("language_model", "the model"),
        ("traced_wrapped_child", "module 'body' of the model"),
        ("traced_child_in_place", "module 'body' of the model"),
    ],
)
def test_a_compiled_model_is_refused(tmp_path, monkeypatch, factory: str, what: str) -> None:
    """A wrapper was traced through and run uncompiled: the profile timed compilations and named
    the layers ``_orig_mod.*``, and training ran without a word about it. A model compiled in
    place, or a compiled module inside a traced model, was traced and run uncompiled too."""
    (tmp_path / "wl_compiled.py").write_text(COMPILED_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"wl_compiled:{factory}"
    message = (
        f"workload {name!r}: {what} is compiled (torch.compile), which pipedream would drop: it "
        "traces the model and runs each stage as traced; return it uncompiled (not "
        "torch.compile(model) or model.compile()); only the children of an nn.Sequential may "
        "be compiled, as they run as given"
    )
    for load in (load_workload, load_model):
        with pytest.raises(WorkloadError) as info:
            load(name, {})
        assert str(info.value) == message


@pytest.mark.parametrize("factory", ["sequential_wrapped_child", "sequential_child_in_place"])
def test_a_sequential_with_a_compiled_layer_is_taken(tmp_path, monkeypatch, factory: str) -> None:
    """An ``nn.Sequential`` is cut between its children and runs them as they are."""
    (tmp_path / "wl_compiled.py").write_text(COMPILED_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = load_workload(f"wl_compiled:{factory}", {}).model
    assert type(model[0]).__name__ == "OptimizedModule" or model[0]._compiled_call_impl


@pytest.mark.parametrize(
    ("version", "torch"),
    [
        ("4.57.1", "2.9.0"), ("4.57.6", "2.13.0"), ("4.57.1+local", "2.9.1+cu128"),
        ("5.0.0", "2.8.0"), ("5.1.0.dev0", "2.8.0+cpu"), ("6.0.0rc1", "2.8.0"), ("dev", "2.8.0"),
        ("4.57.1", "dev"),
    ],
)  # fmt: skip
def test_a_transformers_release_pipedream_is_tested_with_is_taken(version: str, torch: str) -> None:
    from pipedream.workloads.hf_lm import check_transformers_version

    check_transformers_version(version, torch)  # the extra's <6 is pip's to say, not this check's


@pytest.mark.parametrize("version", ["4.46.3", "4.57.0", "4.9.0"])
def test_a_transformers_release_before_the_floor_is_refused(version: str) -> None:
    from pipedream.workloads.hf_lm import check_transformers_version

    with pytest.raises(WorkloadError, match=rf"^transformers {version} is older than 4\.57\.1"):
        check_transformers_version(version, "2.13.0")


def test_transformers_4_on_torch_2_8_is_refused_in_one_line() -> None:
    """torch.export of torch 2.8 fails on transformers 4's attention masks (a vmapped index);
    transformers 5 builds them without it."""
    from pipedream.workloads.hf_lm import check_transformers_version

    with pytest.raises(WorkloadError) as info:
        check_transformers_version("4.57.1", "2.8.0+cu128")
    assert str(info.value) == (
        "transformers 4.57.1 needs torch 2.9 or later here (torch.export of torch 2.8.0+cu128 "
        "fails on its attention masks); upgrade torch, or transformers to 5.x: pip install "
        "'transformers>=5,<6'"
    )


def test_an_older_transformers_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    """Built in, the user's own model (a subclass in the user's module) or a Workload of the
    user's own holding one: a transformers older than pipedream is tested with is refused naming
    the release and the fix (here: the installed one, against a floor above it)."""
    from pipedream.workloads import hf_lm

    transformers = pytest.importorskip("transformers")
    (tmp_path / "wl_own_gpt2.py").write_text(
        "import transformers\n\n"
        "class MyLM(transformers.GPT2LMHeadModel):  # a class of the user's module\n"
        "    pass\n\n"
        "def build():\n"
        "    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)\n"
        "    return MyLM(config)\n\n"
        "def held(microbatch_size: int = 2):  # a Workload of the user's own around one\n"
        "    import torch\n"
        "    from torch.utils.data import TensorDataset\n"
        "    from pipedream.workload import Workload\n"
        "    ids = torch.zeros(8, 4, dtype=torch.long)\n"
        "    return Workload(model=build(), example_input=ids[:microbatch_size],\n"
        "        loss_fn=lambda out, y: out.logits.sum(), dataset=TensorDataset(ids, ids),\n"
        "        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hf_lm, "MIN_TRANSFORMERS", (99, 0, 1))
    message = (
        f"transformers {transformers.__version__} is older than 99.0.1, the oldest pipedream is "
        "tested with; upgrade it: pip install 'transformers>=99.0.1,<6'"
    )
    built_in = [("hf-lm", {"layers": "1"})]
    for name, args in [*built_in, ("wl_own_gpt2:build", {}), ("wl_own_gpt2:held", {})]:
        with pytest.raises(WorkloadError) as info:
            load_workload(name, args)
        assert str(info.value) == message, name
    with pytest.raises(WorkloadError, match=r"^transformers 4\.46\.3 is older than 99\.0\.1"):
        hf_lm.check_transformers_version("4.46.3", "2.13.0")


def test_the_version_check_does_not_import_transformers_models_code() -> None:
    """A process that has imported transformers (a forkserver's preload, a tokenizer) and builds
    another model: asking transformers for PreTrainedModel imported its modeling code, 2 s of
    every rank the test suite forks."""
    pytest.importorskip("transformers")
    code = (
        "import sys, transformers\n"
        "from pipedream.workload import load_workload\n"
        "load_workload('mlp', {})\n"
        "print('transformers.modeling_utils' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "False"
