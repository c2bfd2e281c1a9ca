"""A local search by simulation, from the dynamic program's plan to a faster one beside it.

The dynamic program minimises the cost model's formula; where the planner simulates, the
simulation of the runtime's action tables is what a plan's time is taken to be
(:mod:`~pipedream.optimizer.verify`). The two disagree most on plans the formula likes, so
the plan the formula picks can simulate much slower than one next to it: on the original
VGG-16 profile, 10 workers at 1 GB/s, PipeDream's schedule, the dynamic program's 6-3-1 split
simulates at 148.5 ms per minibatch, and the 9-1 split that merges its first two stages, with
the cut then moved seven layers earlier, at 81.2 ms (on 16 workers: 13-2-1, 77.3 ms; 15-1,
53.6 ms, the split of the PipeDream paper).

:func:`refine` walks from a plan to its fastest neighbour by simulation, as long as one is
faster (steepest descent), within a budget of simulation work. A plan's neighbours
(:func:`neighbours`) are the plans one edit away:

* a cut moved by 1, 2 or 4 layers;
* a replica moved from one stage to another;
* two adjacent stages merged, their replicas added;
* a replicated stage split in two, its replicas shared ``(r - 1, 1)``, ``(r - r//2, r//2)``
  or ``(1, r - 1)``, at the cut that best balances the two stages' compute per replica;
* with :attr:`Moves.fewer_workers`, a replica added to a stage (while workers are idle) or
  taken from one, and under one replica per stage a merge that leaves a worker idle or a
  split that puts an idle one to work.

A neighbour whose lower bound (:mod:`~pipedream.optimizer.bounds`, a sum of the work a
worker, a link or an interface must do per minibatch) already exceeds the fastest time of its
round cannot be the step and is not simulated, so the budget goes to the plans that can be:
on VGG-16, 10 workers, 36 of the 54 plans tried are ruled out so.

On a cluster of several levels a plan is a pipeline of outer stages, each unit of which (a
server, say) runs a pipeline of its own (:mod:`~pipedream.optimizer.tree`). Every innermost
pipeline, over the workers of one unit, takes the edits above. An outer pipeline takes two:

* a cut moved by 1, 2 or 4 layers, the inner pipelines of the stages on either side growing
  or shrinking at that end, down to the workers (where a stage would empty, the move is out);
* a unit moved from one outer stage to another, running that stage's pipeline (where stages
  may be replicated).

Outer stages are neither merged nor split (their units' pipelines would have to be made
anew). On the original VGG-16 profile, 4 servers of 4 workers (10 GB/s inside, 1 GB/s
between), the dynamic program runs a 3-stage pipeline on the fourth server (64.8 ms
simulated); the search gives that server the last 16 layers alone (55.1 ms).
Everything here is pure: the planner supplies the simulation.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pipedream.optimizer.tree import Node, Tree

__all__ = ["SHIFTS", "Moves", "Refined", "neighbours", "refine"]

SHIFTS = (1, 2, 4)
"""The layers by which one cut moves (each way)."""

IMPROVEMENT = 1e-6
"""The relative gain a neighbour needs to replace the plan (not float noise)."""


@dataclass(frozen=True)
class Moves:
    """What a neighbouring plan may be."""

    num_workers: int
    """The workers an innermost pipeline may use: the cluster's on one level, else those of
    one innermost unit."""
    replicate: bool
    """Whether a stage may run on several replicas (the schedule replicates stages alone, and
    ``--straight`` is off)."""
    fewer_workers: bool = False
    """Whether a plan may leave workers idle (``--fewer-workers``); off, every plan uses them
    all."""
    max_stages: int | None = None
    """The most stages a plan may have (2BW: the microbatches per minibatch)."""


@dataclass(frozen=True)
class Refined:
    """Where the search ended."""

    tree: Tree
    """The fastest plan found (the start when no neighbour was faster)."""
    time_ms: float
    """Its simulated time per minibatch."""
    start_ms: float
    """The simulated time per minibatch of the plan the search started from."""
    tried: int
    """Plans tried (the start's neighbours and theirs, each once): simulated, ruled out by
    their lower bound, or left out (they did not fit, or were too big to simulate)."""
    simulated: int
    """Of those, the plans simulated (the others did not fit, were too big to simulate, or
    were ruled out)."""
    ruled_out: int
    """Of those, the plans whose lower bound showed them slower than a plan simulated before,
    and which were not simulated."""
    budget_spent: bool
    """Whether the search stopped at its budget rather than at a plan with no faster
    neighbour."""


def _flat(pipeline: Tree) -> list[tuple[int, int, int]]:
    assert all(not node.inner for node in pipeline), "an innermost pipeline"
    return [(node.first, node.last, node.replicas) for node in pipeline]


def _tree(stages: Sequence[tuple[int, int, int]]) -> Tree:
    return tuple(Node(first, last, replicas) for first, last, replicas in stages)


def _balanced_cut(prefix: Sequence[float], first: int, last: int, left: int, right: int) -> int:
    """The last layer of the first part when ``first..last`` splits into a stage on ``left``
    replicas and one on ``right``, with the two parts' compute per replica closest (the
    earliest such cut on ties)."""

    def worst(cut: int) -> float:
        return max(
            (prefix[cut + 1] - prefix[first]) / left, (prefix[last + 1] - prefix[cut + 1]) / right
        )

    # compute per replica grows with the cut on the left and shrinks on the right: the best
    # cut is the first where the left part's reaches the right part's, or the one before
    target = (prefix[last + 1] * left + prefix[first] * right) / (left + right)
    cut = bisect.bisect_left(prefix, target, first + 1, last + 1) - 1
    return min((c for c in (cut - 1, cut) if first <= c < last), key=lambda c: (worst(c), c))


def neighbours(tree: Tree, moves: Moves, layer_ms: Sequence[float]) -> Iterator[Tree]:
    """The plans one edit from ``tree`` (module docstring), each once, in a fixed order: the
    edits of the outermost pipeline first, then those of each inner pipeline in turn; within
    the innermost pipelines moved cuts, moved replicas, merges, splits, then added and
    removed replicas; within an outer one, moved cuts, then moved units.

    ``layer_ms`` is each layer's compute (forward and backward), to place a split's cut."""
    prefix = [0.0, *itertools.accumulate(layer_ms)]
    seen = {tree}
    for path, pipeline in _pipelines(tree, ()):
        if pipeline[0].inner:
            edited: Iterator[Tree] = _outer_edits(pipeline, moves)
        else:
            edited = (_tree(stages) for stages in _flat_edits(_flat(pipeline), moves, prefix))
        for candidate in edited:
            out = _replaced(tree, path, candidate)
            if moves.max_stages is not None and _num_leaves(out) > moves.max_stages:
                continue
            if out not in seen:
                seen.add(out)
                yield out


def _pipelines(pipeline: Tree, path: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Tree]]:
    """Every pipeline of the plan with its path (the indices of the nodes above it),
    outermost first."""
    yield path, pipeline
    for index, node in enumerate(pipeline):
        if node.inner:
            yield from _pipelines(node.inner, (*path, index))


def _replaced(pipeline: Tree, path: tuple[int, ...], new: Tree) -> Tree:
    """``pipeline`` with the pipeline at ``path`` replaced by ``new``."""
    if not path:
        return new
    index, node = path[0], pipeline[path[0]]
    inner = _replaced(node.inner, path[1:], new)
    return (
        *pipeline[:index],
        Node(node.first, node.last, node.replicas, inner),
        *pipeline[index + 1 :],
    )


def _num_leaves(pipeline: Tree) -> int:
    """The stages of the flattened plan (the runtime's stages)."""
    return sum(_num_leaves(node.inner) if node.inner else 1 for node in pipeline)


def _resized(node: Node, *, first: int | None = None, last: int | None = None) -> Node | None:
    """``node`` over ``first..last`` (either end kept where None), its inner pipelines' first
    (or last) stages taking the change down to the workers; None where a stage would be
    empty."""
    new_first = node.first if first is None else first
    new_last = node.last if last is None else last
    if new_first > new_last:
        return None
    inner: list[Node | None] = list(node.inner)
    if inner and first is not None:
        inner[0] = _resized(node.inner[0], first=first)
    if inner and last is not None and inner[-1] is not None:
        inner[-1] = _resized(inner[-1], last=last)
    if any(stage is None for stage in inner):
        return None
    return Node(new_first, new_last, node.replicas, tuple(n for n in inner if n is not None))


def _outer_edits(pipeline: Tree, moves: Moves) -> Iterator[Tree]:
    """A pipeline of an outer level, one edit away: a cut moved by :data:`SHIFTS` layers (the
    stages on either side of it, down to the workers, grow and shrink), or a unit moved from
    one stage to another (each unit runs its stage's pipeline, which stays as it is)."""
    for i in range(len(pipeline) - 1):
        for d in (*(-s for s in reversed(SHIFTS)), *SHIFTS):
            cut = pipeline[i].last + d
            left, right = _resized(pipeline[i], last=cut), _resized(pipeline[i + 1], first=cut + 1)
            if left is not None and right is not None:
                yield (*pipeline[:i], left, right, *pipeline[i + 2 :])
    if moves.replicate:
        for i, j in itertools.permutations(range(len(pipeline)), 2):
            if pipeline[i].replicas > 1:
                edited = list(pipeline)
                edited[i] = Node(
                    pipeline[i].first, pipeline[i].last, pipeline[i].replicas - 1, pipeline[i].inner
                )
                edited[j] = Node(
                    pipeline[j].first, pipeline[j].last, pipeline[j].replicas + 1, pipeline[j].inner
                )
                yield tuple(edited)


def _flat_edits(
    stages: list[tuple[int, int, int]], moves: Moves, prefix: Sequence[float]
) -> Iterator[list[tuple[int, int, int]]]:
    """An innermost pipeline (``(first, last, replicas)`` per stage), one edit away (module
    docstring), in :func:`neighbours`' order; ``moves.num_workers`` are the workers it may
    use (a unit's)."""
    used = sum(r for _, _, r in stages)

    for i in range(len(stages) - 1):  # the cut after stage i
        (a_first, a_last, a_r), (_, b_last, b_r) = stages[i], stages[i + 1]
        for d in (*(-s for s in reversed(SHIFTS)), *SHIFTS):
            cut = a_last + d
            if a_first <= cut < b_last:
                edited = [*stages[:i], (a_first, cut, a_r), (cut + 1, b_last, b_r)]
                yield [*edited, *stages[i + 2 :]]
    if moves.replicate:
        for i, j in itertools.permutations(range(len(stages)), 2):
            if stages[i][2] > 1:
                edited = list(stages)
                edited[i] = (*stages[i][:2], stages[i][2] - 1)
                edited[j] = (*stages[j][:2], stages[j][2] + 1)
                yield edited
    for i in range(len(stages) - 1):
        (first, _, a_r), (_, last, b_r) = stages[i], stages[i + 1]
        if moves.replicate:
            yield [*stages[:i], (first, last, a_r + b_r), *stages[i + 2 :]]
        elif moves.fewer_workers:
            yield [*stages[:i], (first, last, 1), *stages[i + 2 :]]
    for i, (first, last, r) in enumerate(stages):
        if first == last:
            continue
        if moves.replicate:
            shares = sorted({(r - 1, 1), (r - r // 2, r // 2), (1, r - 1)}, reverse=True)
        elif moves.fewer_workers and used < moves.num_workers:
            shares = [(1, 1)]
        else:
            continue
        for left, right in shares:
            if left >= 1 and right >= 1:
                cut = _balanced_cut(prefix, first, last, left, right)
                halves = [(first, cut, left), (cut + 1, last, right)]
                yield [*stages[:i], *halves, *stages[i + 1 :]]
    if moves.replicate and moves.fewer_workers:
        for i, (first, last, r) in enumerate(stages):
            if used < moves.num_workers:
                yield [*stages[:i], (first, last, r + 1), *stages[i + 1 :]]
            if r > 1:
                yield [*stages[:i], (first, last, r - 1), *stages[i + 1 :]]


def refine(
    start: Tree,
    start_ms: float,
    *,
    simulate: Callable[[Tree], tuple[float | None, int]],
    moves: Moves,
    layer_ms: Sequence[float],
    budget: int,
    bound: Callable[[Tree], float] | None = None,
    slack: float = 0.0,
) -> Refined:
    """Steepest descent from ``start`` (simulated at ``start_ms``): simulate every neighbour
    of the current plan not tried before, move to the fastest if it is faster by more
    than :data:`IMPROVEMENT`, and stop where none is, or once the simulations' work adds up
    to ``budget``; then the fastest plan seen is kept.

    ``simulate(tree)`` gives the plan's time per minibatch (None where it does not fit or
    cannot be simulated) and the work the simulation took, in the units of ``budget`` (0:
    no simulation ran).
    ``bound(tree)``, where given, is a lower bound on that time: a neighbour whose bound
    exceeds the fastest time of its round by more than ``slack`` (relative) cannot be the
    step, nor later ones (the fastest time only falls), and is not simulated.
    """
    current, current_ms = start, start_ms
    seen = {start}
    tried = simulated = ruled_out = spent = 0
    while True:
        best, best_ms = current, current_ms
        spent_all = False
        for tree in neighbours(current, moves, layer_ms):
            if tree in seen:
                continue
            if spent >= budget:
                spent_all = True
                break
            seen.add(tree)
            tried += 1
            if bound is not None and bound(tree) > best_ms * (1 + slack):
                ruled_out += 1
                continue
            time_ms, work = simulate(tree)
            spent += work
            simulated += work > 0
            if time_ms is not None and time_ms < best_ms:
                best, best_ms = tree, time_ms
        improved = best_ms < current_ms * (1 - IMPROVEMENT)
        if improved:
            current, current_ms = best, best_ms
        if spent_all or not improved:
            return Refined(
                current, current_ms, start_ms, tried, simulated, ruled_out, budget_spent=spent_all
            )
