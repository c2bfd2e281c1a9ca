"""What a plan's stages send each other, from the profile's values (pure code, no torch).

The runtime wires stages from the traced model (:func:`pipedream.graph.stage_ios`): every
stage sends each later stage the values it makes that the later stage uses, the first stage
also the model inputs, and a model output made before the last stage goes to the last stage
(the loss). Gradients go back the same way, for the values that carry one. This module applies
the same rules to a profile's :class:`~pipedream.formats.ProfileValue` entries, so that the
simulator and the trace reader build the tables the runtime runs, skip connections included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipedream.errors import PlanningError
from pipedream.formats.plan import Plan
from pipedream.formats.profile import Profile

__all__ = ["StageMessages", "stage_messages", "stages_of_layers"]


@dataclass(frozen=True)
class StageMessages:
    """The messages of one forward and one backward of a microbatch, per stage pair."""

    edges: tuple[tuple[int, int], ...]
    """(producer stage, consumer stage) pairs that exchange tensors, sorted."""
    activation_bytes: dict[tuple[int, int], int]
    """Bytes the producer sends the consumer on every forward."""
    gradient_bytes: dict[tuple[int, int], int]
    """Bytes the consumer sends back on every backward (the values that carry a gradient)."""


def stages_of_layers(plan: Plan, profile: Profile) -> list[int]:
    """The stage of every layer of ``profile`` under ``plan`` (their layer names must match)."""
    index = {name: i for i, name in enumerate(profile.layer_names)}
    stage_of = [-1] * len(index)
    for number, stage in enumerate(plan.stages):
        for name in (stage.first_layer, stage.last_layer):
            if name not in index:
                raise PlanningError(
                    f"stage {number} of the plan names layer {name!r}, which the profile of "
                    f"{profile.workload} does not have; pass the profile the plan was made from "
                    "with --profile"
                )
        for layer in range(index[stage.first_layer], index[stage.last_layer] + 1):
            stage_of[layer] = number
    return stage_of


def stage_messages(profile: Profile, stage_of: Sequence[int]) -> StageMessages | None:
    """The stage pairs and their message sizes for layers placed as ``stage_of`` says (a stage
    per layer, non-decreasing); None if the profile has no values (a chain).

    >>> from pipedream.formats import LayerProfile, ProfileValue
    >>> layers = tuple(LayerProfile(n, "", 1.0, 1.0, 8, 0) for n in "abc")
    >>> values = (ProfileValue("x", 4, None, ("a", "c"), grad=False),
    ...           ProfileValue("y", 8, "a", ("b", "c")), ProfileValue("z", 8, "b", ("c",)),
    ...           ProfileValue("out", 2, "c", (), loss=True))
    >>> profile = Profile("demo", 1, "cpu", "float32", layers, values=values)
    >>> messages = stage_messages(profile, [0, 1, 2])
    >>> messages.edges
    ((0, 1), (0, 2), (1, 2))
    >>> messages.activation_bytes[(0, 2)], messages.gradient_bytes[(0, 2)]  # x and y; y's grad
    (12, 8)
    """
    if profile.values is None:
        return None
    index = {name: i for i, name in enumerate(profile.layer_names)}
    last_stage = max(stage_of)
    activations: dict[tuple[int, int], int] = {}
    gradients: dict[tuple[int, int], int] = {}
    for value in profile.values:
        producer = 0 if value.made_by is None else stage_of[index[value.made_by]]
        consumers = {stage_of[index[layer]] for layer in value.used_by}
        if value.loss:
            consumers.add(last_stage)
        for consumer in sorted(consumers):
            assert consumer >= producer, (value, producer, consumer)  # the format checks order
            if consumer == producer:
                continue
            pair = (producer, consumer)
            activations[pair] = activations.get(pair, 0) + value.bytes
            gradients[pair] = gradients.get(pair, 0) + (value.bytes if value.grad else 0)
    return StageMessages(tuple(sorted(activations)), activations, gradients)
