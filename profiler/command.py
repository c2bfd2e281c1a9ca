"""``pipedream profile``: measure a workload's layers (or import a PipeDream graph) to a YAML file.

::

    pipedream profile WORKLOAD [--workload-arg KEY=VALUE ...] [--microbatch-size B]
                      [--precision fp32|bf16|fp16] [--concurrent K] -o PROFILE
    pipedream profile --from-pipedream graph.txt -o PROFILE

The measurement runs on the first GPU when CUDA is available, else on the CPU with torch's
current number of threads (set ``OMP_NUM_THREADS`` / ``torch.set_num_threads`` to match the
workers that will train; the summary line shows the value used). Where several CPU ranks will
share a host, ``--concurrent K`` measures while ``K - 1`` co-runners train the same workload
(:mod:`pipedream.profiler.corunners`). ``--precision bf16`` (``fp16``) measures the forwards
in autocast, as ``pipedream train --precision bf16`` (``fp16``) runs them
(:mod:`pipedream.precision`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import nn

from pipedream.data import MicrobatchStream
from pipedream.formats.profile import (
    MAX_LAYERS,
    ActionOverhead,
    LayerProfile,
    PassSpread,
    Profile,
    ProfileValue,
    TiedParameter,
    save_profile,
)
from pipedream.formats.units import format_bytes
from pipedream.graph import LayerGraph
from pipedream.host_memory import configure_host_memory
from pipedream.model_io import batch_size, call_model, map_tensors, tensors_in
from pipedream.precision import DEFAULT_PRECISION, PRECISIONS, SCALES_LOSS, autocast, loss_input
from pipedream.profiler.corunners import Corunners, CorunnerSpec
from pipedream.profiler.graph_profile import (
    graph_tied_parameters,
    graph_values,
    layer_graph,
    measure_graph,
)
from pipedream.profiler.measure import (
    ProfilerError,
    check_repetitions,
    measure_sequential,
    tied_parameters,
)
from pipedream.profiler.overhead import measure_data_reads, measure_loss, measure_overhead
from pipedream.runtime.loss_scale import check_scalable
from pipedream.runtime.out_of_memory import torch_summary
from pipedream.wording import count
from pipedream.workload import Workload, load_workload, parse_workload_args, recorded_args

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_WARMUP",
    "MAX_CONCURRENT",
    "default_device",
    "format_table",
    "profile_workload",
    "run",
]

DEFAULT_WARMUP = 3
"""Untimed runs per layer before the timed ones (``--warmup``)."""
DEFAULT_REPEATS = 10
"""Timed runs per layer, of which the median is kept (``--repeats``)."""
MAX_CONCURRENT = 256
"""Most processes ``--concurrent`` trains on one host: more than the largest hosts have cores
(100000 started that many processes)."""


def default_device() -> torch.device:
    """``cuda:0`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def _human_bytes(num: int | None) -> str:
    if num is None:
        return "-"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(profile: Profile) -> str:
    """Per-layer table (times in ms, sizes in binary units) followed by a totals row."""
    header = (
        "layer",
        "type",
        "fwd ms",
        "bwd ms",
        "update ms",
        "output",
        "params",
        "saved",
        "optim state",
    )
    rows = []
    for layer in profile.layers:
        rows.append(
            (
                layer.name,
                layer.type if len(layer.type) <= 40 else layer.type[:37] + "...",
                f"{layer.forward_ms:.3f}",
                f"{layer.backward_ms:.3f}",
                "-" if layer.update_ms is None else f"{layer.update_ms:.3f}",
                _human_bytes(layer.output_bytes),
                _human_bytes(layer.parameter_bytes),
                _human_bytes(layer.saved_bytes),
                _human_bytes(layer.optimizer_state_bytes),
            )
        )

    def total(values: list[int | None]) -> int | None:
        return None if any(v is None for v in values) else sum(v or 0 for v in values)

    layers = profile.layers
    rows.append(
        (
            "total",
            f"{len(layers)} layers",
            f"{sum(layer.forward_ms for layer in layers):.3f}",
            f"{sum(layer.backward_ms for layer in layers):.3f}",
            "-"
            if any(layer.update_ms is None for layer in layers)
            else f"{sum(layer.update_ms or 0.0 for layer in layers):.3f}",
            "",
            _human_bytes(sum(layer.parameter_bytes for layer in layers)),
            _human_bytes(total([layer.saved_bytes for layer in layers])),
            _human_bytes(total([layer.optimizer_state_bytes for layer in layers])),
        )
    )
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    table = [line(header), rule, *(line(row) for row in rows[:-1]), rule, line(rows[-1])]
    if profile.overhead is not None:
        extra = profile.overhead
        table.append(
            f"runtime cost per action (added by the simulator): forward {extra.forward_ms:.3f} "
            f"ms, backward {extra.backward_ms:.3f} ms, update {extra.update_ms:.3f} ms; reading "
            f"a microbatch: inputs {extra.inputs_ms:.3f} ms (first stage), targets "
            f"{extra.targets_ms:.3f} ms (last stage); the loss: {extra.loss_forward_ms:.3f} ms "
            f"forward, {extra.loss_backward_ms:.3f} ms backward (last stage)"
        )
    for tied in profile.tied:
        table.append(
            f"tied: {tied.name} ({_human_bytes(tied.bytes)}) is used by {', '.join(tied.layers)} "
            f"(counted in {tied.layers[0]}; a stage holding a later one keeps a copy)"
        )
    if profile.spread is not None:
        spread = profile.spread
        table.append(
            f"whole passes varied (pass_spread, for simulate --spread): forward "
            f"{min(spread.forward):.2f}-{max(spread.forward):.2f} x the median, backward "
            f"{min(spread.backward):.2f}-{max(spread.backward):.2f} x"
        )
    return "\n".join(table)


def _check_layer_count(count: int, what: str, fix: str, *, model: str = "the model") -> None:
    """Refuse, before measuring or writing, a model of more layers than a profile may hold."""
    if count > MAX_LAYERS:
        raise ProfilerError(
            f"{model} has {count} {what}, at most {MAX_LAYERS} supported (planning grows "
            f"with the square of the layers); {fix}"
        )


def profile_workload(
    name: str,
    workload_args: dict[str, str],
    *,
    microbatch_size: int | None = None,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    device: torch.device | None = None,
    depth: int | None = None,
    patterns: Sequence[str] = (),
    concurrent: int = 1,
    precision: str = DEFAULT_PRECISION,
) -> Profile:
    """Build workload ``name`` and measure every layer of its model.

    An ``nn.Sequential`` is measured child by child; any other model, or any model with
    ``depth``/``patterns`` (``--depth``, ``--layers``), through its ``torch.export`` graph.
    The runtime's own cost per action is measured too (:mod:`pipedream.profiler.overhead`), and
    how much the whole passes varied (:class:`~pipedream.formats.PassSpread`).
    With ``concurrent`` K > 1 (CPU only), K - 1 co-runner processes train the same workload
    meanwhile, as the other ranks of a host do (:mod:`pipedream.profiler.corunners`).
    ``precision``: what the forwards run in (:mod:`pipedream.precision`).
    """
    if microbatch_size is not None and microbatch_size < 1:
        raise ProfilerError(f"--microbatch-size must be >= 1, got {microbatch_size}")
    check_repetitions(warmup, repeats)
    if precision not in PRECISIONS:
        raise ProfilerError(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    if not 1 <= concurrent <= MAX_CONCURRENT:
        raise ProfilerError(
            f"--concurrent must be 1 to {MAX_CONCURRENT} (processes training on the host), got "
            f"{concurrent}"
        )
    if depth is not None and patterns:
        raise ProfilerError(
            f"give --depth ({depth}) or --layers ({', '.join(patterns)}), not both: each "
            "chooses the layers on its own"
        )
    device = device or default_device()
    if concurrent > 1 and device.type != "cpu":
        raise ProfilerError(
            f"--concurrent {concurrent} is for CPU ranks sharing a host, but the profile runs "
            f"on {device}, where every rank has a device of its own; leave --concurrent out "
            "(or profile on the CPU with the GPUs hidden: CUDA_VISIBLE_DEVICES= pipedream "
            "profile ...)"
        )
    workload = load_workload(name, workload_args, microbatch_size=microbatch_size)
    if precision in SCALES_LOSS:  # a profile no run could train in
        check_scalable(workload.model, where="profile --precision fp16")
    spec = CorunnerSpec(
        name,
        dict(workload_args),
        microbatch_size,
        torch.get_num_threads(),
        tuple(sys.path),
        precision=precision,
    )
    try:
        graph = _layers(workload, device, depth=depth, patterns=patterns)
        with Corunners(spec, num_corunners=concurrent - 1):
            measured = _measure(
                workload, device, graph, warmup=warmup, repeats=repeats, precision=precision
            )
    except torch.OutOfMemoryError as exc:
        raise ProfilerError(
            f"the model ran out of memory on {device} ({torch_summary(str(exc))}): the profile "
            "runs the whole model, its optimizer state and one microbatch's activations on one "
            "device; profile on one with more memory, or with a smaller --microbatch-size (the "
            "plan's microbatches are then that size)"
        ) from None
    param = next(iter(workload.model.parameters()), None)
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    return Profile(
        workload=name,
        microbatch_size=batch_size(workload.example_input),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        layers=measured.layers,
        precision=precision,
        device_memory=_device_memory(device),
        input_bytes=sum(t.numel() * t.element_size() for t in tensors_in(workload.example_input)),
        cut_bytes=measured.cut_bytes,
        workload_args=recorded_args(name, workload_args),
        overhead=measured.overhead,
        concurrent=concurrent,
        spread=measured.spread,
        tied=measured.tied,
        values=measured.values,
    )


def _device_memory(device: torch.device) -> int | None:
    """A GPU's total memory in bytes; None on the CPU (the ranks of a host share its memory,
    which no limit per worker describes)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


@dataclass(frozen=True)
class _Measured:
    """What :func:`_measure` found: the profile's measured fields."""

    layers: tuple[LayerProfile, ...]
    cut_bytes: tuple[int, ...] | None
    """Bytes across every cut (a traced model; None for an ``nn.Sequential``'s chain)."""
    values: tuple[ProfileValue, ...] | None
    """The tensors that cross layers (a traced model; None for a chain)."""
    overhead: ActionOverhead
    spread: PassSpread | None
    tied: tuple[TiedParameter, ...]


def _layers(
    workload: Workload, device: torch.device, *, depth: int | None, patterns: Sequence[str]
) -> LayerGraph | None:
    """The layers to measure: the traced graph grouped into them, or None for the children of
    an ``nn.Sequential``; refused when there are more than a profile holds (before any
    co-runner starts or anything is measured)."""
    model = workload.model.to(device)
    if isinstance(model, nn.Sequential) and depth is None and not patterns:
        _check_layer_count(
            len(model),
            "children of its nn.Sequential",
            "group them into fewer, larger modules (an nn.Sequential of blocks)",
        )
        return None
    example = map_tensors(lambda t: t.to(device), workload.example_input)
    graph = layer_graph(model, example, depth=depth, patterns=patterns)
    _check_layer_count(
        len(graph.layers),
        "layers in its traced graph",
        "profile coarser layers: a smaller --depth, or --layers patterns",
    )
    return graph


def _measure(
    workload: Workload,
    device: torch.device,
    graph: LayerGraph | None,
    *,
    warmup: int,
    repeats: int,
    precision: str,
) -> _Measured:
    """The layers' costs, the bytes across every cut of a traced model (``graph``; None: the
    children of an ``nn.Sequential``) and the tensors that cross them, the runtime's costs, how
    much the whole passes varied, the parameters several layers use; all in ``precision``."""
    model = workload.model.to(device)
    example = map_tensors(lambda t: t.to(device), workload.example_input)
    cut_bytes = values = None
    passes: list[tuple[float, float]] = []
    options = {
        "warmup": warmup,
        "repeats": repeats,
        "optimizer": workload.optimizer,
        "precision": precision,
    }
    if graph is None:
        layers = measure_sequential(model, example, passes=passes, **options)
        tied = tied_parameters(
            [
                (name, child.named_parameters(prefix=name, remove_duplicate=False))
                for name, child in model.named_children()
            ]
        )
    else:
        sizes: dict[str, int] = {}  # under autocast a value's dtype is not the trace's
        layers = measure_graph(graph, model, example, passes=passes, value_bytes=sizes, **options)
        cut_bytes = tuple(graph.cut_bytes(sizes))
        values = tuple(graph_values(graph, sizes))
        tied = graph_tied_parameters(graph, model)
    overhead = measure_overhead(
        workload.optimizer, device=device, warmup=warmup, repeats=repeats, precision=precision
    )
    stream = MicrobatchStream(workload.dataset, batch_size(workload.example_input), seed=0)
    inputs_ms, targets_ms = measure_data_reads(
        stream, device=device, warmup=warmup, repeats=repeats
    )
    with torch.no_grad(), autocast(precision, device):
        output = map_tensors(functools.partial(loss_input, precision), call_model(model, example))
    loss_forward_ms, loss_backward_ms = measure_loss(
        workload.loss_fn,
        output,
        stream,
        device=device,
        warmup=warmup,
        repeats=repeats,
    )
    overhead = dataclasses.replace(
        overhead,
        inputs_ms=inputs_ms,
        targets_ms=targets_ms,
        loss_forward_ms=loss_forward_ms,
        loss_backward_ms=loss_backward_ms,
    )
    spread = PassSpread.from_passes(passes)
    return _Measured(tuple(layers), cut_bytes, values, overhead, spread, tuple(tied))


def _share_the_host_like_ranks(concurrent: int, out: TextIO) -> None:
    """Threads and cores as ``concurrent`` ranks of ``./launch.sh`` on this host would have.

    torchrun gives every rank one thread when it starts several per node and
    ``OMP_NUM_THREADS`` is not set; so does the profile here (the co-runners copy the
    profiler's number of threads). More processes than cores is allowed (an oversubscribed
    host is what it is) but said, since the times then include the waits for a core.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = concurrent * torch.get_num_threads()
    if cores is not None and threads > cores:
        print(
            f"note: --concurrent {concurrent} x {count(torch.get_num_threads(), 'thread')} = "
            f"{threads} busy threads on {cores} CPU cores: the layers' times include waiting for "
            "a core",
            file=out,
        )


def run(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Entry point of ``pipedream profile`` (user errors raise ``PipedreamError``)."""
    out = out or sys.stdout
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    if args.from_pipedream:
        if args.workload:
            raise ProfilerError(
                f"give either a workload ({args.workload!r}) or --from-pipedream, not both"
            )
        measuring = {
            "--workload-arg": args.workload_arg,
            "--microbatch-size": args.microbatch_size,
            "--depth": getattr(args, "depth", None),
            "--layers": getattr(args, "layers", None),
            "--concurrent": None if getattr(args, "concurrent", 1) == 1 else args.concurrent,
            "--precision": getattr(args, "precision", None),
            "--warmup": args.warmup,
            "--repeats": args.repeats,
        }
        given = [option for option, value in measuring.items() if value not in (None, [])]
        if given:
            raise ProfilerError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for measuring a "
                "workload; an imported profile measures nothing: leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        from pipedream.profiler.pipedream_import import import_pipedream_graph

        profile = import_pipedream_graph(args.from_pipedream)
        _check_layer_count(
            len(profile.layers),
            "nodes in its graph",
            "merge nodes of the graph into coarser layers",
            model=args.from_pipedream,
        )
        how = f"imported from {args.from_pipedream}"
    else:
        if not args.workload:
            raise ProfilerError(
                "no workload given; write e.g. `pipedream profile mlp -o profile.yaml` "
                "or import one with --from-pipedream graph.txt"
            )
        configure_host_memory()  # as in `pipedream train`, so the times match the runtime's
        concurrent = getattr(args, "concurrent", 1)
        if concurrent > 1:
            _share_the_host_like_ranks(concurrent, out)
        profile = profile_workload(
            args.workload,
            parse_workload_args(args.workload_arg),
            microbatch_size=args.microbatch_size,
            warmup=warmup,
            repeats=repeats,
            device=torch.device(args.device) if getattr(args, "device", None) else None,
            depth=getattr(args, "depth", None),
            patterns=tuple(getattr(args, "layers", None) or ()),
            concurrent=concurrent,
            precision=getattr(args, "precision", None) or DEFAULT_PRECISION,
        )
        cpu = profile.device == "cpu"
        threads = f", {count(torch.get_num_threads(), 'CPU thread')}" if cpu else ""
        autocast_note = (
            f" in {profile.precision} (autocast)" if profile.precision != DEFAULT_PRECISION else ""
        )
        others = profile.concurrent - 1
        beside = (
            f", {others} more process{'es' if others > 1 else ''} training beside it "
            f"(--concurrent {profile.concurrent})"
            if others
            else ""
        )
        memory = (
            f" ({format_bytes(profile.device_memory)})" if profile.device_memory is not None else ""
        )
        how = (
            f"measured on {profile.device}{memory}{autocast_note}{threads}{beside}, median of "
            f"{repeats} runs after {warmup} warm-up"
        )
    save_profile(profile, args.output)
    if getattr(args, "plot", None):
        from pipedream.profiler.plot import plot_profile

        plot_profile(profile, args.plot)
    print(f"{profile.workload}: microbatch size {profile.microbatch_size}, {how}", file=out)
    print(format_table(profile), file=out)
    print(f"wrote {args.output}", file=out)
    return 0
