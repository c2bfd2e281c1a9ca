"""Routing a stage's tensors to and from its peers (skip connections included).

A stage module takes a flat list of inputs and returns a flat list of outputs, named by
:class:`~pipedream.graph.StageIO`. Messages are per peer stage: a producer sends each consumer
the outputs that consumer uses; a consumer's inputs are its producers' messages in ascending
stage order. Gradients travel the same routes backwards, but for the values that carry none
(``StageIO.no_grad``: integer tensors, attention masks); an output used by several consumers
gets the sum of their gradients.
"""

from __future__ import annotations

from torch import Tensor

from pipedream.graph.layers import StageIO

__all__ = [
    "gather_inputs",
    "gather_output_grads",
    "input_needs_grad",
    "scatter_input_grads",
    "scatter_outputs",
    "sequential_ios",
]


def sequential_ios(num_stages: int) -> list[StageIO]:
    """The wiring of a plain chain: one tensor from each stage to the next."""
    ios = []
    for stage in range(num_stages):
        last = stage == num_stages - 1
        inputs = ("input",) if stage == 0 else (f"a{stage - 1}",)
        producer = -1 if stage == 0 else stage - 1
        outputs = ("output",) if last else (f"a{stage}",)
        consumers = () if last else ((stage + 1, outputs),)
        ios.append(StageIO(stage, inputs, ((producer, inputs),), outputs, consumers))
    return ios


def gather_inputs(io: StageIO, received: dict[int, list[Tensor]]) -> list[Tensor]:
    """The stage's inputs, in ``io.inputs`` order, from the producers' messages."""
    out: list[Tensor] = []
    for producer, values in io.producers:
        tensors = received[producer]
        assert len(tensors) == len(values), (io.stage, producer, len(tensors), values)
        out += tensors
    return out


def scatter_outputs(io: StageIO, outputs: list[Tensor]) -> dict[int, list[Tensor]]:
    """One message per consumer stage."""
    by_name = dict(zip(io.outputs, outputs))
    return {consumer: [by_name[v] for v in values] for consumer, values in io.consumers}


def gather_output_grads(io: StageIO, received: dict[int, list[Tensor]]) -> list[Tensor | None]:
    """The gradient of each output (``io.outputs`` order), summed over its consumers; None for
    the outputs that carry no gradient."""
    total: dict[str, Tensor] = {}
    for consumer, values in io.consumers:
        carried = [value for value in values if value not in io.no_grad]
        assert len(carried) == len(received[consumer]), (io.stage, consumer, carried)
        for value, grad in zip(carried, received[consumer]):
            total[value] = grad if value not in total else total[value] + grad
    return [total.get(value) for value in io.outputs]


def scatter_input_grads(io: StageIO, grads: list[Tensor]) -> dict[int, list[Tensor]]:
    """The inputs' gradients (``io.inputs`` order), one message back to each producer stage,
    without those of the inputs that carry none."""
    out: dict[int, list[Tensor]] = {}
    position = 0
    for producer, values in io.producers:
        if producer >= 0:
            out[producer] = [
                grad
                for value, grad in zip(values, grads[position : position + len(values)])
                if value not in io.no_grad
            ]
        position += len(values)
    return out


def input_needs_grad(io: StageIO) -> tuple[bool, ...]:
    """Per input of the stage (``io.inputs`` order), whether its gradient is sent back."""
    return tuple(value not in io.no_grad for value in io.inputs)
