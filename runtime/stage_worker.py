"""The compute of one stage replica: forward, backward, update, with weight stashing.

A :class:`StageWorker` knows nothing about communication: the distributed executor and the
single-process reference executor feed it tensors and ship what it returns. This keeps the
numerics in one place, so both interpreters of an action table compute exactly the same thing.

Tied parameters shared with other stages (:class:`TiedLinks`): a tensor this stage *owns* is an
ordinary parameter of it, to whose gradient the copies' gradients are added before the update;
a *copy* of another stage's tensor is not trained here (the optimizer and the weight versions
leave it out): every forward uses the copy's current value (the owner's version for that
microbatch, received right before), its gradient goes to the owner, and each new version from
the owner replaces its value.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pipedream.data import MicrobatchStream
from pipedream.errors import RunFailure
from pipedream.graph.placement import place_module
from pipedream.model_io import ModelIO, to_device
from pipedream.precision import autocast, loss_input
from pipedream.runtime.backward_split import BackwardSplit, Deferred, weight_gradients
from pipedream.runtime.forward_buffers import ForwardBuffers
from pipedream.runtime.lr_schedule import LrSchedule, scheduled_lr
from pipedream.runtime.parameter_swap import ParameterSwap
from pipedream.runtime.rng_state import RngState, capture, replayed
from pipedream.runtime.weight_versions import WeightVersions, accumulate_grads
from pipedream.schedules import Action, Op

__all__ = ["NonFiniteLossError", "StageWorker", "TiedLinks", "WorkerConfig"]


class NonFiniteLossError(RunFailure):
    """The loss of a microbatch was NaN or infinite."""


@dataclass(frozen=True)
class WorkerConfig:
    """How a stage replica computes."""

    stage: int
    """Stage index."""
    num_stages: int
    """Number of stages in the pipeline."""
    microbatches: int
    """Microbatches per minibatch (the loss of each is divided by this)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the stage's parameters and activations live."""
    recompute: bool = False
    """Keep only the stage inputs in forward and recompute the forward in backward."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (autocast; the weights keep their dtype): :mod:`pipedream.precision`."""
    skip_nonfinite: bool = False
    """On a NaN/inf loss, give the microbatch a zero gradient and count it instead of stopping."""
    replicas: int = 1
    """Replicas of the stage: an update applies that many minibatches (the learning-rate
    schedule's minibatch index is the first of them, :mod:`pipedream.runtime.lr_schedule`)."""
    replica_phase: int = 0
    """The run's first minibatch modulo ``replicas``: not 0 where a run resumes another plan's
    checkpoint at a step that is not a multiple of them (every stretch between checkpoints is a
    multiple, so the updates' first minibatches are ``version x replicas + phase``)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class TiedLinks:
    """A stage's tied parameters shared with other stages, by local parameter name.

    Each list is in the order of the tensors' canonical names, so an owner's list for a copy
    stage pairs up with that stage's list for the owner (the local names may differ: an
    ``nn.Sequential`` stage names a tensor by its own child).
    """

    owned: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Copy stage -> this stage's parameters that the copy stage holds copies of."""
    copies: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Owner stage -> this stage's copies of that stage's parameters."""

    @property
    def copy_names(self) -> frozenset[str]:
        return frozenset(name for names in self.copies.values() for name in names)


@dataclass
class _Stashed:
    """What a forward leaves for its backward."""

    version: int
    inputs: list[Tensor]
    live: bool = False
    """The forward ran on the live parameters themselves (see :meth:`StageWorker._runs_live`):
    its backward accumulates their gradients the way a plain ``loss.backward()`` does."""
    outputs: list[Tensor] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    loss: Tensor | None = None
    targets: Any = None
    """With recomputation, on the last stage: the microbatch's targets on the device, for the
    recomputed loss (read once, as without recomputation)."""
    copies: dict[str, Tensor] = field(default_factory=dict)
    """With recomputation: the tied copies' values the forward used (a new version may come
    before the backward)."""
    rng: RngState | None = None
    """With recomputation: the random generators' state the forward started from, so that the
    recomputed forward draws the same numbers (dropout masks)."""
    record: Deferred | None = None
    """Split backwards: the module outputs the forward recorded."""
    deferred: dict[nn.Module, list[Tensor]] = field(default_factory=dict)
    """Split backwards, after I: the outputs of the modules whose weights wait for W."""
    output_grads: dict[nn.Module, list[Tensor | None]] = field(default_factory=dict)
    """Split backwards, after I: those outputs' gradients."""


class StageWorker:
    """Runs the forward, backward and update actions of one stage replica."""

    def __init__(
        self,
        config: WorkerConfig,
        module: nn.Module,
        table: Sequence[Action],
        *,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        data: MicrobatchStream | None,
        initial_version: int = 0,
        model_io: ModelIO | None = None,
        tied: TiedLinks | None = None,
        input_grads: Sequence[bool] | None = None,
        lr_schedule: LrSchedule | None = None,
        loss_scale: Tensor | None = None,
    ) -> None:
        self.config = config
        self.lr_schedule = lr_schedule
        self.loss_scale = loss_scale
        """fp16's loss scale, which the last stage multiplies its losses by before their
        backwards (a device tensor the scaler changes in place; None: no scaling)."""
        """The workload's learning-rate factor per minibatch (None: the optimizer's own)."""
        self.tied = tied or TiedLinks()
        self.module = place_module(_own_copies(module, self.tied.copy_names), config.device)
        self.loss_fn = loss_fn
        self.data = data
        self.model_io = model_io or ModelIO()
        self.input_grads = None if input_grads is None else tuple(input_grads)
        """Per received input, whether its gradient goes back (None: every floating one)."""
        named = dict(self.module.named_parameters())
        self._copies = {name: named[name] for name in sorted(self.tied.copy_names)}
        self._frozen = frozenset(name for name, p in named.items() if not p.requires_grad)
        """Parameters the user froze (``requires_grad=False``): no gradient, no update."""
        trained = [p for name, p in named.items() if name not in self._copies]
        # a stage without parameters of its own (or only copies) has nothing to step
        self.optimizer = optimizer_factory(trained) if trained else None
        # Autograd makes a parameter's gradient accumulator when a graph first uses it and
        # frees it with the graph: a plain loop keeps its graph (the loss) to the optimizer
        # step and reuses them, but a stage's graph is gone when its backward returns. Holding
        # them spares each forward a new accumulator per parameter, and the optimizer's
        # multi-tensor ops a reference handover with the Python object (and its GIL) for each
        # parameter: host work that a GPU step waits for when its kernels are short. They are
        # held by a graph of their own, one scalar per parameter, as a plain loop's graph
        # holds them: held through Python objects of their own (``get_gradient_edge(p).node``),
        # every forward's use of one would take the GIL to count a reference to that object.
        with torch.enable_grad():
            self._accumulator_graph = [p.sum() for p in trained if p.requires_grad]
        name_of = {id(p): name for name, p in named.items()}
        self.param_names = (
            [name_of[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
            if self.optimizer is not None
            else []
        )
        """The names of the optimizer's parameters in its order, which its state dict numbers
        them by (a factory that groups them, weights apart from biases, reorders them)."""
        self._call = ParameterSwap(self.module)
        splits = any(a.op is Op.BACKWARD_INPUT and a.stage == config.stage for a in table)
        self._split = (
            BackwardSplit(self.module, exclude=frozenset(self._copies) | self._frozen)
            if splits
            else None
        )
        """Where the table splits backwards (I and W): which weights wait for W."""
        self.versions = WeightVersions(
            self.module,
            table,
            initial_version=initial_version,
            exclude=self._copies,
            stage=self.config.stage,
        )
        self._stash: dict[int, _Stashed] = {}
        self._buffers = ForwardBuffers(self.module)
        """With recomputation: the buffers a forward updates, kept by the recomputed one."""
        self._grad_listener: Callable[[nn.Parameter], None] | None = None
        self.max_in_flight = 0
        self.skipped: set[int] = set()
        """Microbatches whose non-finite loss was skipped (``skip_nonfinite``)."""
        self.losses: dict[int, Tensor] = {}
        """Unscaled loss of each microbatch (last stage only; detached, on the device, so that
        logging does not synchronise with the GPU after every microbatch)."""
        self._targets: dict[int, Any] = {}
        """Targets read with their microbatch's inputs, until its loss takes them (a lone
        stage)."""

    # -- helpers ---------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        return autocast(self.config.precision, self.config.device)

    def _recording(self) -> contextlib.AbstractContextManager[Deferred | None]:
        """Records the module outputs W starts from, where backwards are split."""
        return self._split.recording() if self._split is not None else contextlib.nullcontext()

    def _runs_live(self, version: int) -> bool:
        """Whether a forward on ``version`` may run on the live parameters themselves.

        It may when ``version`` aliases the live weights (no update comes before its last
        use, so nothing modifies them under autograd), the stage holds no copies of tied
        weights (their values are replaced between versions) and its backwards are not split.
        That is every forward of the synchronous schedules and of a lone stage: they then
        cost what a plain loop's do, with none of the per-parameter work of running on a
        version (a detached alias per tensor, the swap, gradients added one by one).
        """
        return not self._copies and self._split is None and self.versions.aliases_live(version)

    def _run(self, params: dict[str, Tensor] | None, inputs: list[Tensor]) -> list[Tensor]:
        """The stage's outputs on ``params`` (None: on the live parameters)."""
        with self._autocast():
            out = self.module(*inputs) if params is None else self._call(params, inputs)
        # sent in the dtypes the stage made them in, as the next layer takes them in one process
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _leaf_params(
        self, version: int, copies: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        # a copy's value is replaced (never modified) by each new version: the detached alias
        # keeps the version this microbatch started with for its backward
        tensors = {**self.versions.get(version), **(self._copies if copies is None else copies)}
        return {
            name: tensor.detach().requires_grad_(name not in self._frozen)
            for name, tensor in tensors.items()
        }

    def _inputs(self, microbatch: int, received: list[Tensor] | None) -> list[Tensor]:
        if self.config.is_first:
            assert self.data is not None
            if self.config.is_last:  # a lone stage: one read of the samples, as a plain loop
                raw, self._targets[microbatch] = self.data.microbatch(microbatch)
            else:
                raw = self.data.inputs(microbatch)
            return to_device(self.model_io.flatten_inputs(raw), self.config.device)
        assert received is not None
        wanted = self.input_grads or (True,) * len(received)
        assert len(wanted) == len(received), (len(wanted), len(received))
        return [
            t.detach().requires_grad_(w and t.is_floating_point()) for t, w in zip(received, wanted)
        ]

    def _read_targets(self, microbatch: int) -> Any:
        """The targets of a microbatch on the device (the last stage)."""
        assert self.data is not None
        raw = self._targets.pop(microbatch, None)  # read with the inputs (a lone stage)
        if raw is None:
            raw = self.data.targets(microbatch)
        return to_device(raw, self.config.device)

    def _loss(self, microbatch: int, outputs: list[Tensor], targets: Any) -> Tensor:
        """The workload's (unscaled) loss of a microbatch.

        With ``skip_nonfinite`` a non-finite loss is replaced by a constant zero at once: the
        microbatch then contributes a zero gradient to every stage while the schedule runs on
        unchanged. Otherwise the loss is not read here (that would wait for the GPU): the run's
        :class:`~pipedream.runtime.loss_log.LossLog` checks the losses in batches and stops the
        run at the first non-finite one (:class:`NonFiniteLossError`).
        """
        outputs = [loss_input(self.config.precision, output) for output in outputs]
        loss = self.loss_fn(self.model_io.unflatten_outputs(outputs), targets)
        if self.config.skip_nonfinite and not bool(torch.isfinite(loss.detach())):
            self.skipped.add(microbatch)
            return torch.zeros((), device=self.config.device, requires_grad=True)
        return loss

    def start_segment(self, table: Sequence[Action], *, initial_version: int) -> None:
        """Continue with the next table (after a drain), keeping module and optimizer state."""
        assert not self._stash, "a segment must start with an empty pipeline"
        self.versions = WeightVersions(
            self.module,
            table,
            initial_version=initial_version,
            exclude=self._copies,
            stage=self.config.stage,
        )

    # -- actions ---------------------------------------------------------------------------
    def forward(self, action: Action, received: list[Tensor] | None) -> list[Tensor]:
        """Run the forward of ``action.index`` on weight version ``action.version``.

        Returns the tensors to send to the next stage (nothing for the last stage).
        """
        assert action.version is not None
        inputs = self._inputs(action.index, received)
        live = self._runs_live(action.version)
        stash = _Stashed(version=action.version, inputs=inputs, live=live)
        if self.config.recompute:
            # keep only the inputs; backward recomputes the forward on the same version
            stash.copies = {name: p.detach() for name, p in self._copies.items()}
            stash.rng = capture(self.config.device)
            params = None if live else {**self.versions.get(action.version), **stash.copies}
            with torch.no_grad():
                with self._buffers.watching():
                    outputs = self._run(params, inputs)
                if self.config.is_last:
                    stash.targets = self._read_targets(action.index)
                    loss = self._loss(action.index, outputs, stash.targets)
                    if action.index not in self.skipped:
                        self.losses[action.index] = loss
        else:
            if not live:
                stash.params = self._leaf_params(action.version)
            with self._recording() as record:
                outputs = self._run(None if live else stash.params, inputs)
            stash.record = record
            stash.outputs = outputs
            if self.config.is_last:
                stash.loss = self._loss(action.index, outputs, self._read_targets(action.index))
                if action.index not in self.skipped:
                    self.losses[action.index] = stash.loss.detach()
        self._stash[action.index] = stash
        self.max_in_flight = max(self.max_in_flight, len(self._stash))
        return [] if self.config.is_last else [o.detach() for o in outputs]

    def backward(self, action: Action, grads: Sequence[Tensor | None] | None) -> list[Tensor]:
        """Backward of ``action.index`` with the version its forward used.

        Accumulates the parameter gradients into the live parameters and returns the gradients
        of the stage inputs (to send to the previous stage; nothing for the first stage).
        """
        stash = self._stash.pop(action.index)
        assert stash.version == action.version, (stash.version, action)
        roots, root_grads = self._roots(action.index, stash, grads)
        wrt_inputs = [t for t in stash.inputs if t.requires_grad]
        if stash.live:
            # autograd adds the weights' gradients to their .grad, the inputs' to theirs
            if roots:
                torch.autograd.backward(roots, root_grads)
            return self._input_grads(stash.inputs, [t.grad for t in wrt_inputs])
        trained = {n: t for n, t in stash.params.items() if n not in self._frozen}
        self._backward_into_live(roots, root_grads, wrt_inputs, trained)
        return self._input_grads(stash.inputs, [t.grad for t in wrt_inputs])

    def _backward_into_live(
        self,
        roots: list[Tensor],
        root_grads: list[Tensor | None],
        inputs: list[Tensor],
        leaves: dict[str, Tensor],
    ) -> None:
        """A backward on a stashed version whose weight gradients autograd adds straight into
        the live parameters' (and the tied copies') ``.grad``.

        Each version tensor's ``.grad`` is first pointed at its live tensor's, so autograd
        adds each weight gradient in place as soon as it computes it and frees it, as on the
        live path: the next layer's gradient then reuses that memory while it is in cache.
        Taking them all with ``autograd.grad`` and adding them afterwards held every fresh
        gradient to the end of the backward (16 MiB on a stage of the mlp's 1024 x 1024
        layers) and read them back from memory: about 10% slower backwards there.
        """
        targets = {name: self._copies.get(name, self.versions.params.get(name)) for name in leaves}
        for name, leaf in leaves.items():
            leaf.grad = targets[name].grad
        if roots:
            torch.autograd.backward(roots, root_grads, inputs=inputs + list(leaves.values()))
        for name, leaf in leaves.items():
            target = targets[name]
            if leaf.grad is None:
                continue
            if target.grad is None:
                target.grad = leaf.grad  # autograd's own tensor, in the leaf's layout
            if self._grad_listener is not None and name not in self._copies:
                self._grad_listener(target)

    def backward_input(self, action: Action, grads: Sequence[Tensor | None] | None) -> list[Tensor]:
        """The input-gradient half (I) of the backward of ``action.index``: returns the
        gradients of the stage inputs (to send on at once), accumulates those of the weights
        that cannot wait (:mod:`~pipedream.runtime.backward_split`) and keeps what the weight
        half needs: the graph and the gradients of the module outputs it starts from."""
        assert self._split is not None, "a split backward in a table without I actions"
        stash = self._stash[action.index]
        assert stash.version == action.version, (stash.version, action)
        roots, root_grads = self._roots(action.index, stash, grads)
        outputs = self._split.deferred(stash.record or {})
        later = self._split.deferred_names(outputs)
        now = [name for name in stash.params if name not in later and name not in self._frozen]
        wrt_inputs = [t for t in stash.inputs if t.requires_grad]
        flat_outputs = [t for tensors in outputs.values() for t in tensors]
        wrt = wrt_inputs + [stash.params[name] for name in now] + flat_outputs
        computed = iter(self._grad(roots, wrt, root_grads, retain=True))
        input_grads = [next(computed) for _ in wrt_inputs]
        self._accumulate({name: next(computed) for name in now})
        stash.deferred = outputs
        stash.output_grads = {sub: [next(computed) for _ in ts] for sub, ts in outputs.items()}
        return self._input_grads(stash.inputs, input_grads)

    def backward_weight(self, action: Action) -> None:
        """The weight-gradient half (W) of the backward of ``action.index``: the deferred
        weights' gradients from the module outputs' gradients its I computed."""
        assert self._split is not None, "a split backward in a table without W actions"
        if action.index in self.skipped:  # its I dropped it (non-finite loss)
            return
        stash = self._stash.pop(action.index)
        assert stash.version == action.version, (stash.version, action)
        grads = weight_gradients(self._split, stash.deferred, stash.output_grads, stash.params)
        self._accumulate(grads)

    def _roots(
        self, index: int, stash: _Stashed, grads: Sequence[Tensor | None] | None
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """What the backward of ``index`` starts from: the loss (last stage) or the outputs with
        their received gradients (recomputing the forward first, with ``--recompute``)."""
        if self.config.recompute:
            if not stash.live:
                stash.params = self._leaf_params(stash.version, stash.copies)
            assert stash.rng is not None
            with replayed(stash.rng):  # the forward's random draws (dropout masks) again
                with self._recording() as record, self._buffers.kept():
                    stash.outputs = self._run(None if stash.live else stash.params, stash.inputs)
                stash.record = record
                if self.config.is_last:
                    stash.loss = self._loss(index, stash.outputs, stash.targets)
        if self.config.is_last:
            assert stash.loss is not None
            # The minibatch's loss is the mean over its microbatches. Dividing by one would
            # change no bit of the loss or the gradients, but it launches two kernels on a GPU
            # (the division and its backward) that a plain loop does not.
            m = self.config.microbatches
            root = stash.loss / m if m > 1 else stash.loss
            if self.loss_scale is not None:  # fp16: every gradient of the pipeline scaled
                root = root * self.loss_scale
            return [root], [None]
        assert grads is not None and len(grads) == len(stash.outputs)
        pairs = [(o, g) for o, g in zip(stash.outputs, grads) if o.requires_grad and g is not None]
        return [o for o, _ in pairs], [g for _, g in pairs]

    @staticmethod
    def _grad(
        roots: list[Tensor], wrt: list[Tensor], root_grads: list[Tensor | None], *, retain: bool
    ) -> Sequence[Tensor | None]:
        if not roots:  # nothing this stage sends on depends on its parameters or its inputs
            return (None,) * len(wrt)
        return torch.autograd.grad(roots, wrt, root_grads, retain_graph=retain, allow_unused=True)

    def _accumulate(self, param_grads: dict[str, Tensor | None]) -> None:
        """Weight gradients into the live weights; the copies' into the copies (for the owner)."""
        copy_grads = {name: param_grads.pop(name) for name in self._copies if name in param_grads}
        self.versions.accumulate(param_grads)
        accumulate_grads(self._copies, copy_grads)
        if self._grad_listener is not None:
            for name, grad in param_grads.items():
                if grad is not None:
                    self._grad_listener(self.versions.params[name])

    def watch_gradients(self, listener: Callable[[nn.Parameter], None]) -> None:
        """Have ``listener(param)`` called each time a microbatch's gradient (or a tied copy
        stage's) is added to a trained live parameter's ``.grad``: by autograd's post-accumulate
        hooks where the backward accumulates itself, by the worker where it adds them."""
        assert self._grad_listener is None, "one listener per worker"
        self._grad_listener = listener
        for param in self.versions.params.values():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(listener)

    def accumulations(self) -> list[tuple[nn.Parameter, int]]:
        """The trained live parameters (in :meth:`gradients`' order), each with the times its
        ``.grad`` is added to per minibatch: once per microbatch, once per tied copy stage."""
        copies_of = {name: 0 for name in self.versions.params}
        for names in self.tied.owned.values():
            for name in names:
                copies_of[name] += 1
        return [
            (param, self.config.microbatches + copies_of[name])
            for name, param in self.versions.params.items()
            if param.requires_grad
        ]

    def _input_grads(
        self, inputs: Sequence[Tensor], computed: Sequence[Tensor | None]
    ) -> list[Tensor]:
        """The gradient of every stage input, zeros where none flowed (nothing for stage 0)."""
        if self.config.is_first:
            return []
        grads = iter(computed)
        out = []
        for tensor in inputs:
            grad = next(grads) if tensor.requires_grad else None
            out.append(torch.zeros_like(tensor) if grad is None else grad)
        return out

    def skip_backward(self, action: Action) -> list[Tensor]:
        """Drop a microbatch whose loss was non-finite: no parameter gradient, zero input
        gradients for the previous stage (which skips it too, so no 0 * inf anywhere)."""
        stash = self._stash.pop(action.index)
        self.skipped.add(action.index)
        if self.config.is_first:
            return []
        return [torch.zeros_like(t) for t in stash.inputs]

    def gradients(self) -> list[Tensor]:
        """The live parameters' gradients (zeros where a parameter got none); copies of other
        stages' tied parameters are not among them (their gradients go to the owner)."""
        out = []
        for param in self.versions.params.values():
            if not param.requires_grad:
                continue  # frozen: no gradient, no update
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            out.append(param.grad)
        return out

    def present_gradients(self) -> list[Tensor]:
        """The live trained parameters' gradients that exist (a parameter no microbatch
        reached has none), for clipping; no tied copies (their gradients went to the owner)."""
        return [
            param.grad
            for param in self.versions.params.values()
            if param.requires_grad and param.grad is not None
        ]

    def update(self, position: int, *, skip: bool = False) -> None:
        """Optimizer step on the live weights, then they become the next version; ``skip``:
        no step (fp16's overflow), the weights and optimizer state stay, the gradients go."""
        self.versions.release_before(position)
        if self.optimizer is not None and not skip:
            # the first minibatch the update applies: versions count updates
            first = self.versions.live_version * self.config.replicas + self.config.replica_phase
            with scheduled_lr(self.optimizer, self.lr_schedule, first):
                self.optimizer.step()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.versions.updated()

    # -- tied parameters -------------------------------------------------------------------
    @property
    def copy_bytes(self) -> int:
        """Bytes of this stage's copies of other stages' tied parameters."""
        return sum(p.numel() * p.element_size() for p in self._copies.values())

    def copy_gradients(self, owner: int) -> list[Tensor]:
        """The gradients of this stage's copies of ``owner``'s tensors since the last call
        (zeros where none came), to send to the owner, or none at all where no gradient came
        to any (every microbatch of the minibatch skipped for a non-finite loss): zeros would
        give the owner a gradient where a plain loop has none, and Adam's momentum would move
        the tensor. The copies start afresh."""
        params = [self._copies[name] for name in self.tied.copies[owner]]
        grads = [param.grad for param in params]
        for param in params:
            param.grad = None
        if all(grad is None for grad in grads):
            return []
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    @torch.no_grad()
    def add_copy_gradients(self, copy_stage: int, grads: Sequence[Tensor]) -> None:
        """Add a copy stage's gradients to those of the tensors this stage owns (none: its
        copies took no gradient)."""
        if not grads:
            return
        names = self.tied.owned[copy_stage]
        assert len(grads) == len(names), (names, len(grads))
        trained = {n: g.clone() for n, g in zip(names, grads) if n not in self._frozen}
        accumulate_grads(self.versions.params, trained)
        if self._grad_listener is not None:
            for name in trained:
                self._grad_listener(self.versions.params[name])

    def owned_tensors(self, copy_stage: int) -> list[Tensor]:
        """The current values of the tensors ``copy_stage`` holds copies of (fresh tensors:
        the next update changes the live ones in place while the send may still read them)."""
        return [self.versions.params[n].detach().clone() for n in self.tied.owned[copy_stage]]

    @torch.no_grad()
    def set_copies(self, owner: int, tensors: Sequence[Tensor]) -> None:
        """Replace the values of the copies of ``owner``'s tensors with a new version."""
        names = self.tied.copies[owner]
        assert len(tensors) == len(names), (names, len(tensors))
        for name, tensor in zip(names, tensors):
            param = self._copies[name]
            assert tensor.shape == param.shape, (name, tensor.shape, param.shape)
            param.data = tensor.to(device=param.device, dtype=param.dtype)

    def release(self, position: int) -> None:
        self.versions.release_before(position)


def _own_copies(module: nn.Module, names: Iterable[str]) -> nn.Module:
    """``module`` with each copy of another stage's tied parameter (``names``, under any of
    its names in ``module``) a tensor of its own, before the module moves to its device.

    A stage module shares its tensors, and its submodules, with the model it was cut from, so
    where the owner's stage runs on the same rank (the V's first and last stage) the copy
    would otherwise be the owner's very parameter: its gradient would add to the owner's
    before the handover, and each new version would overwrite the owner's weights. Every
    module on the way to a copy is therefore a shallow copy of its own (its other parameters,
    buffers and untouched children still shared, its hooks its own): a module that the
    owner's stage also calls keeps the owner's tensor there. Every name of a copy (a tensor
    registered twice) gets the new tensor, and a module that appears twice in the stage stays
    one module.
    """
    originals = {id(module.get_parameter(name)) for name in names}
    if not originals:
        return module
    tensors: dict[int, nn.Parameter] = {}
    rebuilt: dict[int, nn.Module] = {}

    def own(param: nn.Parameter) -> nn.Parameter:
        if id(param) not in tensors:
            tensors[id(param)] = nn.Parameter(
                param.detach().clone(), requires_grad=param.requires_grad
            )
        return tensors[id(param)]

    def rebuild(sub: nn.Module) -> nn.Module:
        if not any(id(p) in originals for p in sub.parameters()):
            return sub
        if id(sub) not in rebuilt:
            fresh = copy.copy(sub)
            for key, value in vars(sub).items():  # hooks registered later stay its own
                if isinstance(value, (dict, set)) and key != "_buffers":
                    fresh.__dict__[key] = copy.copy(value)
            fresh._parameters = {
                key: own(p) if p is not None and id(p) in originals else p
                for key, p in sub._parameters.items()
            }
            fresh._modules = {
                key: None if child is None else rebuild(child)
                for key, child in sub._modules.items()
            }
            rebuilt[id(sub)] = fresh
        return rebuilt[id(sub)]

    return rebuild(module)
