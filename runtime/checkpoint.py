"""Checkpoints: one directory per step, one file per stage, a manifest written last.

Layout (docs/formats.md, "Checkpoints")::

    checkpoints/step-000100/
        stage-00.pt      {"model": slice of the model's state_dict (the model's own keys),
        stage-01.pt       "optimizer": {"state": {param name: {...}}, "param_groups": [...]},
        ...               "step", "data_position", "stage", "layers"}
        manifest.yaml    format, step, stages with their files and sha256 checksums, and
                         ``tied``: the names of each tensor the model reaches under several

Files are written atomically (temporary name, fsync, rename) and loaded with
``torch.load(weights_only=True)``, so a checkpoint cannot run code. Because every file holds
slices keyed by the model's own names, :func:`load_full_state_dict` rebuilds the whole model's
state dict, and a run can resume under a different plan. A tied tensor (a language model's
embedding that its output head reuses) is stored once, by the first stage that uses it; the
manifest's ``tied`` lists all its names, and :func:`load_full_state_dict` maps each of them to
that one tensor, as the model's own ``state_dict()`` does.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from pipedream.errors import CheckpointError
from pipedream.formats.yamlio import atomic_write_text, new_file_mode
from pipedream.ties import expand_aliases

__all__ = [
    "CHECKPOINT_FORMAT",
    "check_fits",
    "check_stage_file",
    "find_latest_checkpoint",
    "load_full_state_dict",
    "load_manifest",
    "load_stage_file",
    "Restored",
    "optimizer_state_by_name",
    "restore_stage",
    "save_stage_file",
    "step_dir_name",
    "step_directories",
    "tied_names",
    "untaken",
    "write_manifest",
]

CHECKPOINT_FORMAT = "pipedream/checkpoint@1"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """The optimizer's state dict with parameter indices replaced by parameter names."""
    state = optimizer.state_dict()
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def load_optimizer_by_name(
    optimizer: torch.optim.Optimizer, names: list[str], saved: dict[str, Any]
) -> tuple[str, ...]:
    """Inverse of :func:`optimizer_state_by_name` for a (possibly differently split) stage;
    ``names`` are the names of the optimizer's parameters, in its order. Returns the settings
    the workload gives that differ from the checkpoint's, as ``"lr 0.1 -> 0.01"``.

    The state (moments, step counts) is the checkpoint's; the settings of each parameter group
    (learning rate, weight decay, ...) stay the ones the workload gave it, so a run resumed
    with a changed ``lr`` in its ``workload_args`` trains with the new one. Unchanged, they
    equal the saved ones and the resumed run the uninterrupted one. A group is compared with
    the saved group that held its first parameter (a workload's optimizer may give weights and
    biases groups of their own, with their own weight decay or learning rate); where the
    optimizer has several groups, a change names the parameters of its group.
    """
    index = {name: i for i, name in enumerate(names)}
    group_of = {name: group for group in saved["param_groups"] for name in group["params"]}
    groups = optimizer.state_dict()["param_groups"]
    changed = []
    for group in groups:
        members = [names[i] for i in group["params"]]
        source = next((group_of[n] for n in members if n in group_of), None)
        if source is None:
            continue
        which = f" for {_some(members)}" if len(groups) > 1 else ""
        changed += [
            f"{key} {source[key]!r} -> {value!r}{which}"
            for key, value in group.items()
            if key != "params" and key in source and not _same_setting(source[key], value)
        ]
    state = {index[n]: v for n, v in saved["state"].items() if n in index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return tuple(changed)


def _some(names: list[str]) -> str:
    """``names``, the first two of them and how many more: ``"0.bias, 2.bias and 3 more"``."""
    shown = ", ".join(names[:2])
    return shown if len(names) <= 2 else f"{shown} and {len(names) - 2} more"


def _same_setting(saved: Any, given: Any) -> bool:
    """Whether two values of an optimizer setting are equal (a learning rate may be a tensor)."""
    if isinstance(saved, torch.Tensor) or isinstance(given, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(saved), torch.as_tensor(given)))
    return bool(saved == given)


def save_stage_file(directory: Path, stage: int, payload: dict[str, Any]) -> tuple[str, str]:
    """Write ``stage-SS.pt`` atomically; returns (file name, sha256)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"stage-{stage:02d}.pt"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.fchmod(fd, new_file_mode())
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name, _sha256(directory / name)


def write_manifest(
    directory: Path,
    *,
    step: int,
    files: list[tuple[str, str]],
    extra: dict[str, Any],
    tied: Sequence[Sequence[str]] = (),
) -> None:
    """The manifest is written last: a step directory without one is incomplete. ``tied``
    lists the names of each tensor the model reaches under several names."""
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "stages": [{"file": name, "sha256": digest} for name, digest in files],
        **extra,
    }
    if tied:
        manifest["tied"] = [list(names) for names in tied]
    atomic_write_text(directory / "manifest.yaml", yaml.safe_dump(manifest, sort_keys=False))


def load_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / "manifest.yaml"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no manifest.yaml {_not_a_checkpoint(Path(directory))}")
    try:
        manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not valid UTF-8; the checkpoint is corrupt") from None
    except yaml.YAMLError:
        raise CheckpointError(f"{path}: not valid YAML; the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a {CHECKPOINT_FORMAT} manifest")
    step, stages = manifest.get("step"), manifest.get("stages")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: step: expected a whole number >= 0, got {step!r}")
    if (
        not isinstance(stages, list)
        or not stages
        or not all(
            isinstance(e, dict)
            and isinstance(e.get("file"), str)
            and isinstance(e.get("sha256"), str)
            and "/" not in e["file"]
            and e["file"] not in (".", "..")
            for e in stages
        )
    ):
        raise CheckpointError(
            f"{path}: stages: expected a list of {{file, sha256}} entries naming files in the "
            "checkpoint directory; the manifest is corrupt"
        )
    tied = manifest.get("tied", [])
    if not isinstance(tied, list) or not all(
        isinstance(names, list) and len(names) > 1 and all(isinstance(n, str) for n in names)
        for names in tied
    ):
        raise CheckpointError(
            f"{path}: tied: expected a list of lists of two or more tensor names; the manifest "
            "is corrupt"
        )
    return manifest


def tied_names(manifest: dict[str, Any]) -> list[list[str]]:
    """The manifest's groups of names of one tensor (empty for checkpoints without ties)."""
    return [list(names) for names in manifest.get("tied", [])]


def check_stage_file(directory: Path, entry: dict[str, Any]) -> Path:
    """The path of one stage file of the manifest, after checking it is there with its
    checksum (without loading it)."""
    path = directory / str(entry.get("file"))
    if not path.is_file():
        raise CheckpointError(f"{path}: stage file listed in the manifest is missing")
    if _sha256(path) != entry.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch; the file is corrupt or truncated")
    return path


def load_stage_file(directory: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Load one stage file after checking its checksum; never unpickles arbitrary objects."""
    path = check_stage_file(directory, entry)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"{path}: refused to load ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"{path}: not a pipedream stage file")
    return payload


def load_full_state_dict(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's state dict, merged from every stage file of a checkpoint.

    Like ``model.state_dict()``, it holds a tied tensor under each of its names, all of them
    the same tensor object, so ``model.load_state_dict`` and ``torch.save`` keep the tie.
    """
    root = Path(directory)
    manifest = load_manifest(root)
    merged: dict[str, torch.Tensor] = {}
    for entry in manifest["stages"]:
        merged.update(load_stage_file(root, entry)["model"])
    return expand_aliases(merged, tied_names(manifest))


def stage_payload(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    stage: int,
    step: int,
    data_position: int,
    param_names: Sequence[str] | None = None,
    omit: Collection[str] = (),
) -> dict[str, Any]:
    """A stage file's contents: the module's state dict but for the names in ``omit`` (tied
    tensors another stage stores) and the optimizer's state keyed by ``param_names`` (the
    names of its parameters in its order; default: all of the module's). No random
    generator state: the ranks seed theirs at every segment (``runtime/rng_state.py``)."""
    if param_names is None:
        param_names = [name for name, _ in module.named_parameters()]
    return {
        "format": CHECKPOINT_FORMAT,
        "stage": stage,
        "step": step,
        "layers": [name for name, _ in module.named_children()],
        "model": {
            k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in omit
        },
        "optimizer": (
            {"state": {}, "param_groups": []}
            if optimizer is None
            else optimizer_state_by_name(optimizer, list(param_names))
        ),
        "data_position": data_position,
    }


def _not_a_checkpoint(directory: Path) -> str:
    """Why ``directory`` is not a checkpoint, and which to pass: a run's folder, or its
    ``checkpoints`` folder, names its newest step that has a manifest (one a save did not
    finish has none)."""
    for kind, folder in (("a run's folder", directory / "checkpoints"), ("", directory)):
        steps = step_directories(folder)
        if steps:
            what = kind or "a folder of checkpoints"
            saved = [step for step in steps if (step / "manifest.yaml").is_file()]
            if not saved:
                return f"({what}, not a checkpoint); none of its checkpoints was saved whole"
            return (
                f"({what}, not a checkpoint); pass one of its checkpoints, e.g. the newest: "
                f"{saved[-1]}"
            )
    return (
        "(not a checkpoint directory, or an incomplete one); pass a "
        "runs/<run>/checkpoints/step-NNNNNN directory"
    )


def step_directories(checkpoints: Path) -> list[Path]:
    """The ``step-N`` directories under ``checkpoints``, oldest step first (by number: a run
    past step 999999 writes ``step-1000000``, which sorts before ``step-999999`` by name)."""
    if not checkpoints.is_dir():
        return []
    found = []
    for path in checkpoints.iterdir():
        number = path.name.removeprefix("step-")
        if path.is_dir() and path.name.startswith("step-") and number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoints``; corrupt or partial ones are skipped
    with a warning on stderr."""
    for candidate in reversed(step_directories(checkpoints)):
        try:
            manifest = load_manifest(candidate)
            for entry in manifest["stages"]:
                load_stage_file(candidate, entry)
        except CheckpointError as exc:
            print(f"pipedream: skipping checkpoint {candidate}: {exc}", file=sys.stderr)
            continue
        return candidate
    return None


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_stage` took from a checkpoint."""

    taken: frozenset[str]
    """The names of the module's state dict entries it restored."""
    held: frozenset[str]
    """Every name the checkpoint holds a tensor under (a tied tensor under each of them)."""
    tied: tuple[tuple[str, ...], ...]
    """The names of each tied tensor."""
    changed_settings: tuple[str, ...] = ()
    """The optimizer settings the workload gives that differ from the checkpoint's (used)."""


def check_fits(
    wanted: dict[str, torch.Tensor],
    stored: dict[str, torch.Tensor],
    directory: Path,
    *,
    doing: str,
) -> None:
    """The checkpoint at ``directory`` holds every tensor of ``wanted`` (a model's state dict)
    in its shape; a model built with other options, or changed code, does not fit. ``doing``:
    what the user does with it (``resume``, ``evaluate``), for the fix."""
    missing = [key for key in wanted if key not in stored]
    if missing:
        raise CheckpointError(
            f"{directory}: has no tensors for {missing[:3]} (a different model?); {doing} only "
            "with the workload and workload_args the checkpoint was written with"
        )
    for key, value in wanted.items():
        if stored[key].shape != value.shape:
            raise CheckpointError(
                f"{directory}: {key} has shape {tuple(stored[key].shape)}, the model has "
                f"{tuple(value.shape)}; {doing} with the same workload arguments"
            )


def restore_stage(
    directory: Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    param_names: Sequence[str] | None = None,
) -> Restored:
    """Load this stage's slice of weights and optimizer state from any checkpoint layout;
    returns what it took.

    The checkpoint may come from a different plan: tensors and optimizer state are matched by
    the model's parameter names (any of a tied tensor's names), not by stage. ``param_names``
    names the optimizer's parameters in its order (default: all of the module's).
    """
    manifest = load_manifest(directory)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for entry in manifest["stages"]:
        payload = load_stage_file(directory, entry)
        model.update(payload["model"])
        opt_state.update(payload["optimizer"]["state"])
        groups += payload["optimizer"]["param_groups"]  # each stage's: a group per file
    model = expand_aliases(model, tied_names(manifest))
    opt_state = expand_aliases(opt_state, tied_names(manifest))
    aliases = {name: names for names in tied_names(manifest) for name in names}
    groups = [  # a tied parameter in its group under each of its names, as in the state
        {**group, "params": [alias for n in group["params"] for alias in aliases.get(n, [n])]}
        for group in groups
    ]
    wanted = module.state_dict()
    check_fits(wanted, model, directory, doing="resume")
    module.load_state_dict({key: model[key] for key in wanted})
    changed: tuple[str, ...] = ()
    if optimizer is not None:
        if param_names is None:
            param_names = [name for name, _ in module.named_parameters()]
        saved = {"state": opt_state, "param_groups": groups}
        changed = load_optimizer_by_name(optimizer, list(param_names), saved)
    tied = tuple(tuple(names) for names in tied_names(manifest))
    return Restored(frozenset(wanted), frozenset(model), tied, changed)


def untaken(restored: Sequence[Restored]) -> list[str]:
    """The tensors of a checkpoint that none of ``restored`` (what every stage of a resumed
    run took from it) reaches: those of a larger model's layers, which a resume would drop
    silently. A tied tensor counts as taken under any of its names."""
    taken = set().union(*(r.taken for r in restored))
    held = set().union(*(r.held for r in restored))
    groups = {name: set(names) for r in restored for names in r.tied for name in names}
    return sorted(name for name in held - taken if not groups.get(name, set()) & taken)
