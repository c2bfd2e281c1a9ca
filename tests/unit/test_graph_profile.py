"""Graph-based profiling of traced models: exact bytes, skip connections in cut_bytes, and a
clear message when torch.export cannot trace a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import Tensor, nn

from pipedream.errors import WorkloadError
from pipedream.formats import LayerProfile, Profile, ProfileValue, load_profile
from pipedream.graph import LayerGraph, trace_model
from pipedream.graph.stages import stage_ios
from pipedream.optimizer.stage_messages import stage_messages
from pipedream.profiler.graph_profile import graph_values, layer_graph, measure_graph
from pipedream.workload import load_workload

from launching import run_cli

B = 4


def _state_bytes(model: nn.Module, layer: str) -> int:
    module = model.get_submodule(layer)
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_resnet_layers_bytes_are_exact() -> None:
    workload = load_workload("resnet", {"width": "4"}, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input)
    # containers (the stem's Sequential, each layerN) are expanded one level
    assert graph.layers == [
        "stem.0",
        "stem.1",
        "stem.2",
        "layer1.0",
        "layer1.1",
        "layer2.0",
        "layer2.1",
        "pool",
        "fc",
    ]
    layers = measure_graph(graph, workload.model, workload.example_input, warmup=0, repeats=1)
    for layer in layers:
        assert layer.parameter_bytes == _state_bytes(workload.model, layer.name)
    # activations: 4 channels at 16x16 through layer1, 8 channels at 8x8 after layer2.0
    assert [layer.output_bytes for layer in layers] == [
        B * 4 * 16 * 16 * 4,
        B * 4 * 16 * 16 * 4,
        B * 4 * 16 * 16 * 4,
        B * 4 * 16 * 16 * 4,
        B * 4 * 16 * 16 * 4,
        B * 8 * 8 * 8 * 4,
        B * 8 * 8 * 8 * 4,
        B * 8 * 4,
        B * 4 * 4,
    ]
    assert graph.cut_bytes() == [layer.output_bytes for layer in layers[:-1]]
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in layers[:-2])


def test_cut_inside_a_block_carries_the_residual() -> None:
    workload = load_workload("resnet", {"width": "4"}, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input, depth=3)
    cut = graph.layers.index("layer1.0.conv2") - 1  # between bn1/relu and conv2 of a block
    activation = B * 4 * 16 * 16 * 4
    # the block's input (the residual) crosses together with the branch's activation
    assert graph.cut_bytes()[cut] == 2 * activation
    assert len(graph.crossing(cut)) == 2


def test_gpt_at_depth_two_has_the_residual_stream_in_every_cut() -> None:
    args = {"layers": "2", "dim": "32", "heads": "2", "seq": "16"}
    workload = load_workload("gpt", args, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input, depth=2)
    stream = B * 16 * 32 * 4
    cut = graph.layers.index("h0.ln1")  # after the layer norm, before attention
    assert graph.cut_bytes()[cut] == 2 * stream  # normalised activations + residual stream
    cut = graph.layers.index("h0.mlp")  # after a whole block: only the stream
    assert graph.cut_bytes()[cut] == stream


def test_patterns_choose_the_granularity() -> None:
    workload = load_workload("resnet", {"width": "4"}, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input, patterns=["layer1.*"])
    assert graph.layers == ["stem", "layer1.0", "layer1.1", "layer2", "pool", "fc"]  # others whole
    with pytest.raises(WorkloadError, match="matches no module"):
        layer_graph(workload.model, workload.example_input, patterns=["nothing.*"])


@pytest.mark.parametrize(
    "patterns", [["h*", "h0.*"], ["h0.attn"], ["h0.attn", "h0.ln1", "h0.ln2", "h0.mlp"]]
)
def test_a_split_module_keeps_its_other_children_as_layers(patterns: list[str]) -> None:
    """``'h*' 'h0.*'`` dropped the nested glob (h0 stayed whole), and ``'h0.attn'`` put
    ``h0.ln1`` into ``embed`` and ``h0.ln2``, ``h0.mlp`` into ``h0.attn``, under those names."""
    args = {"layers": "2", "dim": "32", "heads": "2", "seq": "16"}
    workload = load_workload("gpt", args, microbatch_size=B)
    graph = layer_graph(workload.model, workload.example_input, patterns=patterns)
    assert graph.layers == [
        "embed", "h0.ln1", "h0.attn", "h0.ln2", "h0.mlp", "h1", "norm", "head"
    ]  # fmt: skip
    depth = layer_graph(workload.model, workload.example_input, depth=2)
    for name in ("h0.ln1", "h0.attn", "h0.ln2", "h0.mlp"):  # the same cuts as --depth 2's
        mine, theirs = graph.layers.index(name), depth.layers.index(name)
        assert graph.cut_bytes()[mine] == depth.cut_bytes()[theirs]


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return self.a(x)
        return x


def test_untraceable_model_gets_a_clear_message() -> None:
    with pytest.raises(WorkloadError) as info:
        trace_model(_DataDependent(), torch.randn(2, 3))
    message = str(info.value)
    assert message.startswith("torch.export could not trace _DataDependent")
    assert "nn.Sequential" in message and "\n" not in message


def test_profile_cli_traces_with_depth_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "profile.yaml"
    result = run_cli(
        "profile",
        "resnet",
        "--workload-arg",
        "width=4",
        "--microbatch-size",
        "4",
        "--depth",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--plot",
        str(tmp_path / "p.png"),
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    profile = load_profile(out)
    assert profile.layer_names[:3] == ["stem.0", "stem.1", "stem.2"]
    assert profile.cut_bytes is not None and len(profile.cut_bytes) == len(profile.layers) - 1
    assert (tmp_path / "p.png").stat().st_size > 1000


GPT_ARGS = {"layers": "2", "dim": "32", "heads": "2", "seq": "16"}


def _cut_from_values(graph: LayerGraph, values: list[ProfileValue], boundary: int) -> int:
    """Bytes of the values made at or before layer ``boundary`` and used after it."""
    index = {name: i for i, name in enumerate(graph.layers)}
    total = 0
    for value in values:
        made = -1 if value.made_by is None else index[value.made_by]
        uses = [index[layer] for layer in value.used_by] + ([len(index)] if value.loss else [])
        if made <= boundary < max(uses):
            total += value.bytes
    return total


@pytest.mark.parametrize(
    ("workload", "args", "depth", "splits"),
    [
        ("resnet", {"width": "4"}, 3, [(4, 9), (2, 7, 15), (1, 5, 6, 20)]),
        ("gpt", GPT_ARGS, 2, [(3, 6), (2, 3, 4, 5, 11)]),
    ],
)
def test_profile_values_wire_stages_as_the_runtime_does(
    workload: str, args: dict[str, str], depth: int, splits: list[tuple[int, ...]]
) -> None:
    """For any split, the stage pairs and their bytes from the profile's values are those of
    the runtime's wiring (stage_ios), and the values add up to every cut's bytes."""
    loaded = load_workload(workload, args, microbatch_size=B)
    graph = layer_graph(loaded.model, loaded.example_input, depth=depth)
    values = graph_values(graph)
    cuts = graph.cut_bytes()
    assert [_cut_from_values(graph, values, b) for b in range(len(cuts))] == cuts
    layers = tuple(LayerProfile(name, "", 1.0, 1.0, 0, 0) for name in graph.layers)
    profile = Profile(workload, B, "cpu", "float32", layers, tuple(cuts), values=tuple(values))
    assert load_profile_text(profile) == profile  # the values survive the file
    skips = 0
    for last_layers in splits:
        starts = [0, *(last + 1 for last in last_layers[:-1])]
        ranges = list(zip(starts, [*last_layers[:-1], len(graph.layers) - 1]))
        ios = stage_ios(graph, ranges)
        stage_of = [s for s, (first, last) in enumerate(ranges) for _ in range(first, last + 1)]
        messages = stage_messages(profile, stage_of)
        assert messages is not None
        wired = {(io.stage, c): names for io in ios for c, names in io.consumers}
        assert messages.edges == tuple(sorted(wired))
        for pair, names in wired.items():
            assert messages.activation_bytes[pair] == sum(graph.value_bytes(v) for v in names)
            carried = [v for v in names if v not in ios[pair[0]].no_grad]
            assert messages.gradient_bytes[pair] == sum(graph.value_bytes(v) for v in carried)
        skips += sum(c > p + 1 for p, c in messages.edges)
    assert skips  # a residual block split around its branch: its input skips a stage


def load_profile_text(profile: Profile) -> Profile:
    return Profile.from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict())))
