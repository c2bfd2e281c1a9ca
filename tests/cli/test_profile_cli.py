"""``pipedream profile`` end to end: a loadable profile, and one clean line for bad input."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.cli import main
from pipedream.formats.profile import load_profile
from pipedream.workload import Workload


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_mlp_writes_a_loadable_profile(tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.yaml"
    code = main(
        [
            "profile",
            "mlp",
            "--workload-arg",
            "layers=2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    profile = load_profile(out)
    assert profile.workload == "mlp"
    assert profile.workload_args == {"layers": "2"}
    assert profile.layer_names == ["0", "1", "2"]
    assert profile.microbatch_size == 32
    assert profile.device in ("cpu", "cuda:0")
    assert profile.dtype == "float32"
    assert [layer.output_bytes for layer in profile.layers] == [
        32 * 64 * 4,
        32 * 64 * 4,
        32 * 4 * 4,
    ]
    assert profile.layers[0].parameter_bytes == (16 * 64 + 64) * 4
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in profile.layers)
    assert all(layer.optimizer_state_bytes == 0 for layer in profile.layers)  # plain SGD
    assert profile.spread is not None  # one timed pass: its own median
    assert (profile.spread.forward, profile.spread.backward) == ((1.0,), (1.0,))
    printed = capsys.readouterr().out
    assert "total" in printed and str(out) in printed
    assert "whole passes varied (pass_spread, for simulate --spread): forward 1.00-1.00" in printed


def test_microbatch_size_option(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    assert (
        main(["profile", "digits", "--microbatch-size", "8", "--repeats", "1", "-o", str(out)]) == 0
    )
    profile = load_profile(out)
    assert profile.microbatch_size == 8
    assert profile.layers[-1].output_bytes == 8 * 10 * 4


@pytest.fixture
def fake_workloads(monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with a workload whose model torch.export cannot trace."""
    module = types.ModuleType("pd_fake_workloads")

    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x  # data-dependent control flow

    def not_sequential() -> Workload:
        return Workload(
            model=DataDependent(),
            example_input=torch.zeros(1, 2),
            loss_fn=nn.functional.mse_loss,
            dataset=torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2)),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )

    module.not_sequential = not_sequential  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pd_fake_workloads", module)
    return "pd_fake_workloads:not_sequential"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["profile", "nope"], "unknown workload 'nope'"),
        (["profile", "mlp", "--workload-arg", "colour=red"], "has no option 'colour'"),
        (["profile", "mlp", "--workload-arg", "layers"], "not KEY=VALUE"),
        (["profile", "mlp", "--workload-arg", "layers=many"], "not a valid int"),
        (["profile"], "no workload given"),
        (["profile", "mlp", "--repeats", "0"], "repeats (--repeats) must be 1 to 100000, got 0"),
        (["profile", "mlp", "--warmup", "-1"], "warmup (--warmup) must be 0 to 100000, got -1"),
        (  # ran for ever
            ["profile", "mlp", "--repeats", "1000000000000"],
            "repeats (--repeats) must be 1 to 100000, got 1000000000000",
        ),
        (["profile", "mlp", "--microbatch-size", "0"], "--microbatch-size must be >= 1"),
        (  # a profile the planner could not hold in memory, after measuring every layer
            ["profile", "mlp", "--workload-arg", "layers=4096"],
            "the model has 4097 children of its nn.Sequential, at most 4096 supported (planning "
            "grows with the square of the layers); group them into fewer, larger modules",
        ),
        (["profile", "mlp", "--from-pipedream", "graph.txt"], "not both"),
        (["profile", "mlp", "--concurrent", "0"], "--concurrent must be 1 to 256"),
        (  # started that many processes
            ["profile", "mlp", "--concurrent", "100000"],
            "--concurrent must be 1 to 256 (processes training on the host), got 100000",
        ),
        (  # --layers won and --depth was ignored
            ["profile", "mlp", "--depth", "1", "--layers", "0"],
            "give --depth (1) or --layers (0), not both: each chooses the layers on its own",
        ),
        (
            ["profile", "--from-pipedream", "graph.txt", "--concurrent", "2"],
            "--concurrent is for measuring a workload; an imported profile measures nothing: "
            "leave it out",
        ),
        (  # accepted and ignored
            ["profile", "--from-pipedream", "graph.txt", "--repeats", "3", "--depth", "2"],
            "--depth, --repeats are for measuring a workload; an imported profile measures "
            "nothing: leave them out",
        ),
        (["profile", "FAKE"], "torch.export could not trace DataDependent"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys, fake_workloads: str
) -> None:
    out = tmp_path / "never.yaml"
    argv = [fake_workloads if arg == "FAKE" else arg for arg in argv]
    try:
        code = main([*argv, "-o", str(out)])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_an_imported_graph_of_more_layers_than_a_profile_holds_is_not_written(
    tmp_path: Path, capsys
) -> None:
    """It was written, and then every `pipedream plan` of it refused it."""
    count = 4097
    nodes = [
        f"node{i} -- ReLU(inplace) -- forward_compute_time=0.5, backward_compute_time=0.2, "
        "activation_size=1000.000, parameter_size=0.000"
        for i in range(count)
    ]
    edges = [f"\tnode{i} -- node{i + 1}" for i in range(count - 1)]
    graph = tmp_path / "graph.txt"
    graph.write_text("\n".join(nodes + edges) + "\n")
    out = tmp_path / "profile.yaml"
    assert main(["profile", "--from-pipedream", str(graph), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"pipedream profile: error: {graph} has 4097 nodes in its graph, at most 4096 supported "
        "(planning grows with the square of the layers); merge nodes of the graph into coarser "
        "layers\n"
    )
    assert not out.exists()


def test_too_many_layers_are_refused_before_any_co_runner_starts(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The co-runners (up to 255 processes) started, built the workload, then were stopped."""
    from pipedream.profiler import command

    def no_corunners(*args: object, **kwargs: object) -> None:
        raise AssertionError("a co-runner started")

    monkeypatch.setattr(command, "Corunners", no_corunners)
    argv = ["profile", "mlp", "--workload-arg", "layers=4096", "--concurrent", "2"]
    assert main([*argv, "-o", str(tmp_path / "p.yaml")]) == 2
    assert "the model has 4097 children of its nn.Sequential" in capsys.readouterr().err
