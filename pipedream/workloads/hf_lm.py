"""``hf-lm``: a Hugging Face ``transformers`` causal language model, built from a config.

The model is built with random weights from a config of one of :data:`FAMILIES` (nothing is
downloaded: the machine may have no internet) and sized by the options: ``layers``, ``dim``,
``heads``, ``kv_heads`` (grouped-query attention, Llama-style families), ``ffn`` (hidden width
of the MLP; default 4 x ``dim``), ``vocab``, ``seq`` (context length), ``tie`` (the output head
reuses the token embedding, as GPT-2 and the small Llamas do). Their dropout is off, so that
forward passes are deterministic and a pipeline's numbers equal one process's. The sizes are checked
before anything is built: ``heads`` divides ``dim``, ``kv_heads`` divides ``heads``, the
families with rotary positions (:data:`ROTARY`) need an even head size ``dim / heads``, and
``vocab`` is at least 2.

``pipedream`` traces it with ``torch.export`` and cuts it where the model's own modules are:
``transformer.wte``, ``transformer.h.0`` .. ``lm_head`` (GPT-2), ``model.embed_tokens``,
``model.layers.0`` .. ``lm_head`` (Llama); a tied head's matrix lives on the embedding's stage and
the head's stage keeps a copy.

Data: the ``gpt`` workload's seeded sparse Markov stream (the best possible loss is known and
reported), or the token file ``tokens=PATH``: a 1-D array of token ids in ``.npy`` or ``.pt``, or
``.bin`` (``uint16``, nanoGPT's format), cut into windows of ``seq + 1`` tokens, the last
``test_samples`` held out. The ids must be integers from 0 to ``vocab - 1`` (a file of floats or
of negative ids is refused, not cast or left to fail in the embedding). ``pipedream profile``
records a relative ``PATH`` as an absolute one (against the directory it runs in), so the plans
made from the profile read the same file wherever they are launched (on several nodes, each
needs it at that path); a relative path in a plan written by hand is read from the directory the
ranks start in. With ``padding=true`` every sequence ends after a random length
(at least half of ``seq``) with padding: the model then takes ``input_ids`` and
``attention_mask``, and the padded positions do not count in the loss.

``pretrained=DIR`` loads the causal LM that ``save_pretrained`` wrote to the local directory
``DIR`` instead, its config giving the sizes and the dropout
(:mod:`pipedream.workloads.hf_pretrained`). A model whose outputs at a position depend on later
tokens is refused (:func:`_check_causal`).

A ``package.module:function`` that returns a ``transformers`` causal LM instead of a
:class:`~pipedream.workload.Workload` is trained the same way (:func:`wrap`): the
``--workload-arg`` options its function does not take go to :func:`wrap`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError
from pipedream.torch_support import release_numbers
from pipedream.workload import Workload
from pipedream.workloads.common import optimizer_factory, warmup_decay
from pipedream.workloads.gpt import entropy_rate, markov_chain, sample_sequences

__all__ = [
    "FAMILIES",
    "IGNORE",
    "ROTARY",
    "PaddedTokens",
    "build",
    "hf_config",
    "lm_loss",
    "wrap",
]

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
"""Config families ``config=`` accepts."""
ROTARY = ("llama", "mistral", "qwen2")
"""The families with rotary position embeddings, which need an even head size."""
IGNORE = -100
"""Target of a position that does not count in the loss (padding)."""
DEFAULT_SEQ = 64
"""Tokens per training window, where neither the options nor the model's context say less."""
_EVAL_CHUNK = 32
"""Held-out sequences evaluated at once."""


MIN_TRANSFORMERS = (4, 57, 1)
"""The oldest ``transformers`` pipedream trains (the floor of ``pyproject.toml``'s hf extra)."""
MIN_TORCH_FOR_TRANSFORMERS_4 = (2, 9)
"""The oldest torch that traces a ``transformers`` 4 model: 4.x builds its attention masks by
indexing inside ``torch.vmap``, which ``torch.export`` of torch 2.8 fails on ("Current active
mode ProxyTorchDispatchMode not registered"). transformers 5 traces on torch 2.8."""


def _transformers() -> Any:
    """The ``transformers`` module; a missing or too old one is refused in one line."""
    try:
        import transformers
    except ImportError:
        raise WorkloadError(
            "hf-lm needs the transformers package; install the extra: pip install -e '.[hf]'"
        ) from None
    check_transformers_version(transformers.__version__, torch.__version__)
    return transformers


def check_transformers_version(version: str, torch_version: str) -> None:
    """Refuse a ``transformers`` release older than :data:`MIN_TRANSFORMERS` (``"4.46.3"``),
    and a 4.x on a torch older than :data:`MIN_TORCH_FOR_TRANSFORMERS_4`; a later release, a
    local or development build of one (``"5.1.0.dev0"``, ``"4.57.1+local"``) and a version that
    does not start with a release number pass."""
    release = release_numbers(version)
    if release is None:
        return
    if release < MIN_TRANSFORMERS:
        floor = ".".join(map(str, MIN_TRANSFORMERS))
        raise WorkloadError(
            f"transformers {version} is older than {floor}, the oldest pipedream is "
            f"tested with; upgrade it: pip install 'transformers>={floor},<6'"
        )
    torch_release = release_numbers(torch_version)
    if release[0] == 4 and torch_release is not None:
        if torch_release[:2] < MIN_TORCH_FOR_TRANSFORMERS_4:
            floor = ".".join(map(str, MIN_TORCH_FOR_TRANSFORMERS_4))
            raise WorkloadError(
                f"transformers {version} needs torch {floor} or later here (torch.export of "
                f"torch {torch_version} fails on its attention masks); upgrade torch, or "
                "transformers to 5.x: pip install 'transformers>=5,<6'"
            )


def hf_config(
    config: str,
    *,
    layers: int,
    dim: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    tie: bool,
) -> Any:
    """The ``transformers`` config of a model of family ``config`` at the given size."""
    _check_sizes(
        config,
        layers=layers,
        dim=dim,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab=vocab,
        seq=seq,
    )
    transformers = _transformers()
    kv_heads = kv_heads or heads
    ffn = ffn or 4 * dim
    common = {"vocab_size": vocab, "tie_word_embeddings": tie, "use_cache": False}
    if config == "gpt2":
        if kv_heads != heads:
            raise WorkloadError("hf-lm: gpt2 has no grouped-query attention; leave kv_heads out")
        return transformers.GPT2Config(
            n_layer=layers,
            n_embd=dim,
            n_head=heads,
            n_inner=ffn,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
            **common,
        )
    classes = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
    }
    if config not in classes:
        raise WorkloadError(
            f"hf-lm: unknown config {config!r}; use one of {', '.join(FAMILIES)} (or your own "
            "package.module:function returning a transformers model)"
        )
    return getattr(transformers, classes[config])(
        num_hidden_layers=layers,
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=seq,
        attention_dropout=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        pad_token_id=None,
        **common,
    )


def _check_sizes(
    config: str, *, layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int
) -> None:
    """Refuse a size that ``transformers`` or ``torch.export`` would fail on, or that leaves
    nothing to learn, in one line that names the option."""
    for name, value in (("layers", layers), ("dim", dim), ("heads", heads)):
        if value < 1:
            raise WorkloadError(f"hf-lm: {name} must be >= 1, got {value}")
    for name, value, default in (("kv_heads", kv_heads, "one per head"), ("ffn", ffn, "4 x dim")):
        if value < 0:
            raise WorkloadError(f"hf-lm: {name} must be >= 1 (or 0 for {default}), got {value}")
    if vocab < 2:
        raise WorkloadError(
            f"hf-lm: vocab must be >= 2, got {vocab}; a model with one token has nothing to predict"
        )
    if seq < 2:
        raise WorkloadError(f"hf-lm: seq must be >= 2, got {seq}")
    if dim % heads:
        raise WorkloadError(
            f"hf-lm: dim={dim} is not divisible by heads={heads}; pick heads that divide dim"
        )
    if heads % (kv_heads or heads):
        raise WorkloadError(
            f"hf-lm: heads={heads} is not a multiple of kv_heads={kv_heads}; each group of "
            "query heads shares one key/value head"
        )
    if config in ROTARY and (dim // heads) % 2:
        raise WorkloadError(
            f"hf-lm: {config} needs an even head size for its rotary position embeddings, but "
            f"dim/heads = {dim}/{heads} = {dim // heads}; pick dim and heads with an even "
            f"quotient, e.g. dim={2 * dim} heads={heads}"
        )


def _check_stream(*, branching: int, vocab: int, tokens: str) -> None:
    """Refuse a synthetic stream (no ``tokens`` file) whose ``branching`` the vocab cannot give."""
    if not tokens and not 1 <= branching <= vocab:
        raise WorkloadError(
            f"hf-lm: branching must be 1 to vocab={vocab} (each token's distinct successors in "
            f"the synthetic stream), got {branching}; choose one in that range, or a larger vocab"
        )


def lm_loss(output: Any, target: Tensor) -> Tensor:
    """Mean next-token cross entropy over the positions that count (target != ``IGNORE``).

    ``output``: the model's output (its ``logits`` ``[B, T, V]``) or the logits themselves.
    """
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE
    )


class PaddedTokens(Dataset[tuple[dict[str, Tensor], Tensor]]):
    """Sequences padded at the end: items ``({"input_ids", "attention_mask"}, targets)``."""

    def __init__(self, windows: Tensor, lengths: Tensor) -> None:
        seq = windows.shape[1] - 1
        positions = torch.arange(seq)
        real = positions[None, :] < lengths[:, None]
        self.input_ids = torch.where(real, windows[:, :-1], 0)
        self.attention_mask = real.long()
        self.targets = torch.where(real, windows[:, 1:], IGNORE)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[dict[str, Tensor], Tensor]:
        inputs = {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index]}
        return inputs, self.targets[index]


def _read_tokens(path: str) -> Tensor:
    """The token ids in file ``path``: a 1-D integer array (not yet checked against vocab)."""
    file = Path(path)
    if not file.is_file():
        raise WorkloadError(_missing_tokens(path))
    try:
        tokens = _load_tokens(file, path)
    except WorkloadError:
        raise
    except Exception as exc:
        raise WorkloadError(
            f"hf-lm: tokens={path!r}: cannot read it ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(tokens, Tensor) or tokens.dim() != 1:
        raise WorkloadError(f"hf-lm: tokens={path!r}: expected a 1-D array of integer token ids")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise WorkloadError(_not_integers(path, str(tokens.dtype).removeprefix("torch.")))
    return tokens.long()


def _missing_tokens(path: str) -> str:
    """The message for a token file that is not there; a relative path says where it looked."""
    if Path(path).is_absolute():
        return f"hf-lm: tokens={path!r}: no such file; give a .npy, .pt or .bin file"
    return (
        f"hf-lm: tokens={path!r}: no such file in {Path.cwd()}, where a relative path is read "
        "from; give the absolute path of a .npy, .pt or .bin file"
    )


def _not_integers(path: str, dtype: str) -> str:
    """The message for a token file of floats, booleans or anything else but integer ids."""
    return (
        f"hf-lm: tokens={path!r} holds {dtype} values, not integer token ids; save the ids as "
        "integers (e.g. int64; .bin files hold uint16)"
    )


def _load_tokens(file: Path, path: str) -> Any:
    """What the token file holds: a tensor for ``.npy`` and ``.bin``, anything for ``.pt``."""
    import numpy as np

    if file.suffix == ".npy":
        array = np.load(file)
        if array.dtype.kind not in "iu":  # a cast would truncate floats to ids silently
            raise WorkloadError(_not_integers(path, str(array.dtype)))
        return torch.from_numpy(array.astype("int64"))
    if file.suffix == ".pt":
        return torch.load(file, weights_only=True)
    if file.suffix == ".bin":
        return torch.from_numpy(np.fromfile(file, dtype=np.uint16).astype("int64"))
    raise WorkloadError(
        f"hf-lm: tokens={path!r}: unknown format {file.suffix!r}; give a .npy or .pt "
        "array of token ids, or a .bin file of uint16 ids (nanoGPT's format)"
    )


def _windows(
    *,
    tokens: str,
    vocab: int,
    seq: int,
    samples: int,
    test_samples: int,
    branching: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, float | None]:
    """Training and held-out windows of ``seq + 1`` tokens, and the best loss if known."""
    if not tokens:
        chain = markov_chain(vocab, branching, generator)
        train = sample_sequences(chain, num_sequences=samples, length=seq + 1, generator=generator)
        test = sample_sequences(
            chain, num_sequences=test_samples, length=seq + 1, generator=generator
        )
        return train, test, entropy_rate(chain)
    ids = _read_tokens(tokens)
    if len(ids) and int(ids.min()) < 0:
        raise WorkloadError(
            f"hf-lm: tokens={tokens!r} holds token id {int(ids.min())}; ids must be 0 to "
            f"vocab-1={vocab - 1} (drop or replace the negative ones, e.g. padding markers)"
        )
    if len(ids) and int(ids.max()) >= vocab:
        raise WorkloadError(
            f"hf-lm: tokens={tokens!r} holds token id {int(ids.max())}, not below vocab={vocab}; "
            f"pass --workload-arg vocab={int(ids.max()) + 1} (or more)"
        )
    count = max(0, len(ids) - 1) // seq
    if count < test_samples + 1:
        raise WorkloadError(
            f"hf-lm: tokens={tokens!r} has {len(ids)} tokens: {count} windows of seq={seq}, "
            f"not enough for test_samples={test_samples} held out and one to train on"
        )
    windows = torch.stack([ids[i * seq : i * seq + seq + 1] for i in range(count)])
    train, test = windows[: count - test_samples], windows[count - test_samples :]
    return (train[:samples] if samples else train), test, None


def _dataset(windows: Tensor, padding: bool, generator: torch.Generator) -> Dataset[Any]:
    if not padding:
        return TensorDataset(windows[:, :-1].clone(), windows[:, 1:].clone())
    seq = windows.shape[1] - 1
    lengths = torch.randint(max(1, seq // 2), seq + 1, (len(windows),), generator=generator)
    return PaddedTokens(windows, lengths)


_SIZES: dict[str, Any] = {
    "config": "gpt2",
    "layers": 2,
    "dim": 64,
    "heads": 4,
    "kv_heads": 0,
    "ffn": 0,
    "vocab": 256,
    "tie": True,
}
"""The options that shape a model built from a config, and their defaults; a ``pretrained``
model's own config gives them."""


def build(
    config: str | None = None,
    layers: int | None = None,
    dim: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    tie: bool | None = None,
    pretrained: str = "",
    padding: bool = False,
    tokens: str = "",
    samples: int = 2048,
    test_samples: int = 128,
    branching: int = 4,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    weight_decay: float | None = None,
    warmup: int = 0,
    decay: int = 0,
    seed: int = 0,
    data_seed: int = 0,
    microbatch_size: int = 8,
) -> Workload:
    """A ``transformers`` causal LM of family ``config`` with random weights, or the one saved
    in directory ``pretrained`` (see the module docstring); every call with the same arguments
    gives identical weights and data."""
    given = {"config": config, "layers": layers, "dim": dim, "heads": heads}
    given |= {"kv_heads": kv_heads, "ffn": ffn, "vocab": vocab, "tie": tie}
    data: dict[str, Any] = {  # what wrap takes besides seq
        "padding": padding,
        "tokens": tokens,
        "samples": samples,
        "test_samples": test_samples,
        "branching": branching,
        "lr": lr,
        "optimizer": optimizer,
        "weight_decay": weight_decay,
        "warmup": warmup,
        "decay": decay,
        "data_seed": data_seed,
        "microbatch_size": microbatch_size,
    }
    if pretrained:
        shaped = [name for name, value in given.items() if value is not None]
        return _pretrained(pretrained, sizes=shaped, seed=seed, seq=seq, **data)
    sizes = {name: _SIZES[name] if value is None else value for name, value in given.items()}
    seq = DEFAULT_SEQ if seq is None else seq
    transformers = _transformers()
    settings = hf_config(
        sizes["config"], seq=seq, **{k: v for k, v in sizes.items() if k != "config"}
    )
    vocab = sizes["vocab"]
    _check_stream(branching=branching, vocab=vocab, tokens=tokens)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        model = transformers.AutoModelForCausalLM.from_config(settings)
    workload = wrap(model, seq=seq, **data)
    kv_heads, heads = sizes["kv_heads"], sizes["heads"]
    workload.description = (
        f"{sizes['config']} {sizes['layers']}x{sizes['dim']} ({heads} heads"
        + (f", {kv_heads} kv heads" if kv_heads and kv_heads != heads else "")
        + (", tied head" if sizes["tie"] else "")
        + f"), vocab {vocab}, seq {seq}, from transformers {transformers.__version__}; "
        + workload.description
    )
    return workload


def _pretrained(path: str, *, sizes: list[str], seed: int, **data: Any) -> Workload:
    """The workload of the model saved in directory ``path``; ``data``: :func:`wrap`'s options.
    ``sizes``: the shaping options given too, which the directory's config settles instead."""
    from pipedream.workloads.hf_pretrained import load_pretrained

    if sizes:
        them = "it" if len(sizes) == 1 else "them"
        raise WorkloadError(
            f"hf-lm: pretrained={path!r} gives the model's config, so {', '.join(sizes)} "
            f"cannot be set too; leave {them} out (or build from a config without pretrained)"
        )
    model = load_pretrained(path, seed=seed)
    workload = wrap(model, **data)
    settings: Any = model.config
    parameters = sum(p.numel() for p in model.parameters())
    workload.description = (
        f"{settings.model_type} from {path} ({parameters:,} parameters), vocab "
        f"{settings.vocab_size}; {workload.description}"
    )
    return workload


def wrap(
    model: nn.Module,
    *,
    seq: int | None = None,
    padding: bool = False,
    tokens: str = "",
    samples: int = 2048,
    test_samples: int = 128,
    branching: int = 4,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    weight_decay: float | None = None,
    warmup: int = 0,
    decay: int = 0,
    data_seed: int = 0,
    microbatch_size: int = 8,
) -> Workload:
    """A workload that trains ``model``, a ``transformers`` causal LM, on the token stream, in
    windows of ``seq`` tokens (default: 64, or the model's context where it is shorter), with
    ``optimizer`` at ``lr`` and ``weight_decay`` (default: AdamW's 0.01, 0 for the others),
    warmed up and decayed over ``warmup`` and ``decay`` minibatches
    (:func:`~pipedream.workloads.common.warmup_decay`)."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise WorkloadError(
            f"the workload function returned a {type(model).__name__}, not a pipedream Workload "
            "or a transformers causal LM (a model with config.vocab_size)"
        )
    from pipedream.workload import is_transformers_model

    if is_transformers_model(model):
        _transformers()  # refuses a release older than pipedream is tested with
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a cache is state across calls: nothing a pipeline can cut
    model.train()  # from_pretrained gives a model in eval mode: its dropout off
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq is None:
        seq = min(DEFAULT_SEQ, limit) if isinstance(limit, int) else DEFAULT_SEQ
    if isinstance(limit, int) and seq > limit:
        raise WorkloadError(
            f"hf-lm: seq={seq} is longer than the model's {limit} positions; pass "
            f"--workload-arg seq={limit} or less"
        )
    counts = (("seq", seq), ("samples", samples), ("test_samples", test_samples))
    for name, value in (*counts, ("microbatch_size", microbatch_size)):
        if value < 1:
            raise WorkloadError(f"hf-lm: {name} must be >= 1, got {value}")
    _check_stream(branching=branching, vocab=vocab, tokens=tokens)
    generator = torch.Generator().manual_seed(torch_seed(data_seed))
    train, test, best = _windows(
        tokens=tokens,
        vocab=vocab,
        seq=seq,
        samples=samples,
        test_samples=test_samples,
        branching=branching,
        generator=generator,
    )
    dataset = _dataset(train, padding, generator)
    held_out = _dataset(test, padding, generator)
    first = [dataset[i] for i in range(min(microbatch_size, len(dataset)))]
    if len(first) < microbatch_size:
        raise WorkloadError(
            f"hf-lm: {len(dataset)} training sequences, fewer than a microbatch of "
            f"{microbatch_size}; give more data or a smaller microbatch"
        )
    example = _stack([inputs for inputs, _ in first])
    _check_causal(model, example, vocab)
    evaluate = _evaluator(held_out, best)
    source = f"tokens from {tokens}" if tokens else "a sparse Markov stream"
    padded = ", padded (attention_mask)" if padding else ""
    return Workload(
        model=model,
        example_input=example,
        loss_fn=lm_loss,
        dataset=dataset,
        optimizer=optimizer_factory(optimizer, lr=lr, weight_decay=weight_decay),
        evaluate=evaluate,
        lr_schedule=warmup_decay("hf-lm", warmup, decay),
        description=(
            f"{len(dataset)} sequences of {seq} tokens from {source}{padded}"
            + (f" (best loss {best:.2f}, init ~{math.log(vocab):.2f})" if best is not None else "")
        ),
    )


def _check_causal(model: nn.Module, example: Any, vocab: int) -> None:
    """Refuse a model whose logits at a position depend on later tokens: an encoder such as
    BERT, which ``AutoModelForCausalLM`` also builds, would learn to read the next token off
    its input. One short sequence and the same with another last token must agree on every
    earlier position."""
    from pipedream.model_io import call_model

    if isinstance(example, dict):
        probe: Any = {k: v[:1, :8] for k, v in example.items()}
        ids = probe["input_ids"]
    else:
        probe = ids = example[:1, :8]
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    changed = {**probe, "input_ids": other} if isinstance(probe, dict) else other
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            first, second = call_model(model, probe), call_model(model, changed)
    finally:
        model.train(was_training)
    a, b = (getattr(out, "logits", out)[0, :-1] for out in (first, second))
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        raise WorkloadError(
            f"hf-lm: the {type(model).__name__} is not causal: its outputs at a position change "
            "with later tokens (an encoder such as BERT attends both ways), so it would learn to "
            "read the next token off its input; give a decoder-only causal LM (or a config with "
            "is_decoder=True)"
        )


def _stack(items: list[Any]) -> Any:
    if isinstance(items[0], dict):
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}
    return torch.stack(items)


def _evaluator(
    held_out: Dataset[Any], best: float | None
) -> Callable[[nn.Module], dict[str, float]]:
    def evaluate(trained: nn.Module) -> dict[str, float]:
        """Held-out loss of ``trained`` (the mean over the held-out sequences' tokens)."""
        from pipedream.model_io import call_model, map_tensors

        device = next(trained.parameters()).device
        was_training = trained.training
        trained.eval()
        total, count = 0.0, 0
        size = len(held_out)  # type: ignore[arg-type]
        with torch.no_grad():
            for start in range(0, size, _EVAL_CHUNK):
                items = [held_out[i] for i in range(start, min(size, start + _EVAL_CHUNK))]
                inputs = map_tensors(lambda t: t.to(device), _stack([x for x, _ in items]))
                targets = torch.stack([y for _, y in items]).to(device)
                counted = int((targets != IGNORE).sum())
                total += float(lm_loss(call_model(trained, inputs), targets)) * counted
                count += counted
        trained.train(was_training)
        metrics = {"test_loss": total / max(1, count)}
        if best is not None:
            metrics["best_loss"] = best
        return metrics

    return evaluate
