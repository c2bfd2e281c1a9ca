"""``gpt``: a small decoder-only transformer language model on a structured synthetic stream.

Layers (the Sequential's children, each one tensor in, one tensor out, so a pipeline can cut
between any two): ``"embed"`` (token + position embedding, long tokens ``[B, T]`` -> ``[B, T, D]``),
``"h0"`` .. ``"h{layers-1}"`` (pre-norm blocks: causal self-attention + MLP, each with a residual),
``"norm"`` (final LayerNorm) and ``"head"`` (linear, ``[B, T, D]`` -> logits ``[B, T, V]``). With
``tie=true`` the head reuses the token embedding's matrix, as GPT-2 does (``head.weight`` is
``embed.tok.weight``).

Data: sequences from a seeded sparse Markov chain over the vocabulary (every token has
``branching`` possible successors with skewed probabilities). The chain's entropy rate is the
best achievable loss (about 1 nat for the defaults, against log(64) = 4.16 at init), so the loss
visibly falls within a few hundred small steps, and ``evaluate`` reports how far from it a model is.
The chain is stored sparsely (``branching`` successors per token), so a GPT-2-sized vocabulary of
50,257 tokens builds quickly. There is no dropout: the runtime's numerical tests need
forward passes to be deterministic.

The default learning rate (Adam) is 1e-3 up to ``dim=256`` and ``1e-3 * 256 / dim`` above
(:func:`default_learning_rate`). 1e-3 is chosen for PipeDream's stale weights at the default
width: in one-process simulations of a 4-stage pipeline (stage 0 three updates stale) 300
minibatches of 16 reach a held-out loss of ~1.32 (synchronous: ~1.22; best possible 1.08),
while lr=3e-3, slightly better synchronously, degrades to ~1.97 with staleness. Wider models
need less: at GPT-2-small width (``dim=768 layers=12 heads=12 seq=256 vocab=256``) Adam at 1e-3
stays near the unigram loss for its first 40 minibatches of 16 (5.16 after 40, in a plain loop
and in the runtime alike), while 3e-4 is at 1.77 by then.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from pipedream.data import torch_seed
from pipedream.errors import WorkloadError
from pipedream.workload import Workload
from pipedream.workloads.common import check_sizes, optimizer_factory, warmup_decay

__all__ = [
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "MarkovChain",
    "TokenPositionEmbedding",
    "build",
    "build_model",
    "default_learning_rate",
    "entropy_rate",
    "lm_loss",
    "markov_chain",
    "sample_sequences",
]


_EVAL_CHUNK = 32
"""Held-out sequences evaluated at once."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab: int = 64
    """Number of distinct tokens."""
    seq: int = 32
    """Tokens per sequence (the context length)."""
    dim: int = 64
    """Width of the residual stream."""
    layers: int = 4
    """Number of transformer blocks (``h0`` ..)."""
    heads: int = 4
    """Attention heads per block; must divide ``dim``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``dim``."""
    tie: bool = False
    """Whether the output head reuses the token embedding's matrix (tied weights)."""

    def __post_init__(self) -> None:
        if self.vocab < 2:
            raise WorkloadError(
                f"gpt: vocab must be >= 2, got {self.vocab}; a model with one token has nothing "
                "to predict"
            )
        for name in ("vocab", "seq", "dim", "layers", "heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"gpt: {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise WorkloadError(
                f"gpt: dim={self.dim} is not divisible by heads={self.heads}; "
                "pick heads that divide dim"
            )


class TokenPositionEmbedding(nn.Module):
    """Long tokens ``[B, T]`` -> token embedding + learned position embedding ``[B, T, D]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.seq, config.dim)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` only sees positions ``<= t``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, time, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_model(config: GPTConfig) -> nn.Sequential:
    """The model as a Sequential with children embed, h0.., norm, head (GPT-2 style init).

    Uses the global RNG; callers fix it (``build`` forks and seeds it).
    """
    children: OrderedDict[str, nn.Module] = OrderedDict()
    children["embed"] = TokenPositionEmbedding(config)
    for i in range(config.layers):
        children[f"h{i}"] = Block(config)
    children["norm"] = nn.LayerNorm(config.dim)
    children["head"] = nn.Linear(config.dim, config.vocab, bias=False)
    model = nn.Sequential(children)
    residual_std = 0.02 / math.sqrt(2 * config.layers)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # Projections back into the residual stream get a smaller init so the stream's
            # variance does not grow with depth (GPT-2).
            is_residual = name.endswith("attn.proj") or name.endswith("mlp.2")
            nn.init.normal_(module.weight, std=residual_std if is_residual else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    if config.tie:
        head, embed = children["head"], children["embed"]
        assert isinstance(head, nn.Linear) and isinstance(embed, TokenPositionEmbedding)
        head.weight = embed.tok.weight
    return model


def lm_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean next-token cross entropy over all positions.

    ``output``: logits ``[B, T, V]``; ``target``: next tokens ``[B, T]`` (long).
    """
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class MarkovChain:
    """A sparse transition matrix: each token moves to one of ``branching`` successors."""

    successors: Tensor
    """``[V, branching]`` long: the successors of each token (distinct within a row)."""
    probs: Tensor
    """``[V, branching]``: the probability of each successor (rows sum to 1)."""

    @property
    def vocab(self) -> int:
        return int(self.successors.shape[0])


def markov_chain(vocab: int, branching: int, generator: torch.Generator) -> MarkovChain:
    """Each token moves to ``branching`` distinct random successors.

    The successor probabilities are skewed (softmax of Gaussian scores), so some transitions are
    much likelier than others and the chain's entropy is below log(branching). The successors
    of all tokens are drawn at once by Floyd's sampling of distinct numbers, so the cost is
    ``vocab x branching**2``, not ``vocab**2``.
    """
    if not 1 <= branching <= vocab:
        raise WorkloadError(f"gpt: branching must be in 1..vocab={vocab}, got {branching}")
    chosen = torch.empty(vocab, branching, dtype=torch.long)
    for column, top in enumerate(range(vocab - branching, vocab)):
        draw = (torch.rand(vocab, generator=generator) * (top + 1)).long().clamp_(max=top)
        taken = (chosen[:, :column] == draw[:, None]).any(dim=1)
        chosen[:, column] = torch.where(taken, torch.full_like(draw, top), draw)
    scores = torch.randn(vocab, branching, generator=generator)
    return MarkovChain(chosen, torch.softmax(scores, dim=1))


def entropy_rate(chain: MarkovChain) -> float:
    """Entropy in nats per token of the stationary chain: the best achievable mean loss."""
    p64 = chain.probs.double()
    stationary = torch.full((chain.vocab,), 1.0 / chain.vocab, dtype=torch.float64)
    targets = chain.successors.reshape(-1)
    for _ in range(1000):
        flow = (stationary[:, None] * p64).reshape(-1)
        stationary = torch.zeros_like(stationary).index_add_(0, targets, flow)
    logs = torch.where(p64 > 0, p64.log(), torch.zeros_like(p64))
    return float(-(stationary[:, None] * p64 * logs).sum())


def sample_sequences(
    chain: MarkovChain, *, num_sequences: int, length: int, generator: torch.Generator
) -> Tensor:
    """``[num_sequences, length]`` long tokens: uniform first token, then the chain."""
    tokens = torch.empty(num_sequences, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(chain.vocab, (num_sequences,), generator=generator)
    for t in range(1, length):
        previous = tokens[:, t - 1]
        pick = torch.multinomial(chain.probs[previous], 1, generator=generator)[:, 0]
        tokens[:, t] = chain.successors[previous, pick]
    return tokens


def default_learning_rate(dim: int) -> float:
    """Adam's learning rate when none is given: 1e-3 up to width 256, falling as ``1/dim`` above.

    >>> default_learning_rate(64), round(default_learning_rate(768), 6)
    (0.001, 0.000333)
    """
    return 1e-3 * min(1.0, 256 / dim)


def build(
    vocab: int = 64,
    seq: int = 32,
    dim: int = 64,
    layers: int = 4,
    heads: int = 4,
    branching: int = 4,
    samples: int = 4096,
    test_samples: int = 256,
    lr: float | None = None,
    momentum: float = 0.0,
    weight_decay: float | None = None,
    optimizer: str = "adam",
    seed: int = 0,
    data_seed: int = 0,
    tie: bool = False,
    warmup: int = 0,
    decay: int = 0,
    microbatch_size: int = 16,
) -> Workload:
    """Build the GPT workload; every call with the same arguments gives identical weights/data.

    ``seed`` fixes the initial weights, ``data_seed`` the Markov chain and the sequences;
    ``tie`` makes the output head reuse the token embedding's matrix; ``warmup`` and ``decay``
    schedule the learning rate (:func:`~pipedream.workloads.common.warmup_decay`).
    """
    config = GPTConfig(vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads, tie=tie)
    check_sizes("gpt", samples=samples, test_samples=test_samples, microbatch_size=microbatch_size)
    if lr is None:
        lr = default_learning_rate(dim)
    make_optimizer = optimizer_factory(
        optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    schedule = warmup_decay("gpt", warmup, decay)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        model = build_model(config)
    generator = torch.Generator().manual_seed(torch_seed(data_seed))
    chain = markov_chain(vocab, branching, generator)
    train = sample_sequences(chain, num_sequences=samples, length=seq + 1, generator=generator)
    test = sample_sequences(chain, num_sequences=test_samples, length=seq + 1, generator=generator)
    example = sample_sequences(
        chain, num_sequences=microbatch_size, length=seq, generator=generator
    )
    best_loss = entropy_rate(chain)

    def evaluate(trained: nn.Module) -> dict[str, float]:
        """Held-out loss of ``trained``, next to the chain's entropy (the best possible loss)."""
        device = next(trained.parameters()).device
        was_training = trained.training
        trained.eval()
        total = 0.0
        with torch.no_grad():  # in chunks: the logits of a large vocabulary are big
            for chunk in test.split(_EVAL_CHUNK):
                logits = trained(chunk[:, :-1].to(device))
                total += float(lm_loss(logits, chunk[:, 1:].to(device))) * len(chunk)
        loss = total / len(test)
        trained.train(was_training)
        return {"test_loss": loss, "best_loss": best_loss}

    return Workload(
        model=model,
        example_input=example,
        loss_fn=lm_loss,
        dataset=TensorDataset(train[:, :-1].clone(), train[:, 1:].clone()),
        optimizer=make_optimizer,
        evaluate=evaluate,
        lr_schedule=schedule,
        description=(
            f"GPT {layers}x{dim} ({heads} heads{', tied head' if tie else ''}), vocab {vocab}, "
            f"seq {seq}, on a sparse Markov "
            f"chain (best loss {best_loss:.2f}, init ~{math.log(vocab):.2f})"
        ),
    )
