"""Models the examples, tests and benchmarks train: a small byte-level GPT and a wide MLP.

``ByteGPT`` reads bytes (vocabulary 256), so any text trains it without a tokenizer; its layers are
plain modules in a list so that FSDP can wrap each block and a pipeline can cut between them
(:meth:`ByteGPT.stages`). Every model is built from a seed, so every rank builds the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ByteGPT", "GPTConfig", "lm_loss", "wide_mlp"]


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64
    """The longest sequence (tokens = bytes) the model sees."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, length, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        # Plain attention (not a fused kernel): the same arithmetic on every rank and in every
        # layout, so the parallel runs can be compared with the single-process one.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        mask: torch.Tensor = self.mask  # type: ignore[assignment]  # a registered buffer
        scores = scores.masked_fill(~mask[:, :, :length, :length], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(batch, length, channels))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class Embedding(nn.Module):
    """Token and position embeddings: the first layer of the model (and of its first pipeline stage)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence of {length} tokens is longer than the block size {self.block_size}")
        positions = torch.arange(length, device=idx.device)
        out: torch.Tensor = self.tokens(idx) + self.positions(positions)
        return out


class Head(nn.Module):
    """Final layer norm and the projection to byte logits: the model's (and the last stage's) last layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


class ByteGPT(nn.Module):
    """A GPT over bytes: ``layers`` is ``[Embedding, Block x n_layer, Head]``; ``forward(idx)`` gives logits."""

    def __init__(self, config: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList([Embedding(self.config),
                                         *(Block(self.config) for _ in range(self.config.n_layer)),
                                         Head(self.config)])
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
                    if isinstance(module, nn.Linear) and module.bias is not None:
                        nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x

    def stages(self, count: int) -> list[nn.Sequential]:
        """The layers cut into ``count`` consecutive pipeline stages, blocks spread as evenly as possible
        (the embedding goes with the first stage, the head with the last). The stages share this
        model's parameters."""
        n_blocks = self.config.n_layer
        if not 1 <= count <= n_blocks:
            raise ValueError(f"a {n_blocks}-block model cuts into 1..{n_blocks} stages, not {count}")
        layers = list(self.layers)
        bounds = [1 + (n_blocks * i) // count for i in range(count + 1)]
        bounds[0], bounds[-1] = 0, len(layers)
        return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(count)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross entropy, averaged over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def wide_mlp(width: int = 4096, depth: int = 4, inputs: int = 1024, outputs: int = 16, seed: int = 0) -> nn.Sequential:
    """An MLP whose parameters dwarf its compute at a small batch: the communication-heavy benchmark
    model (width 4096, depth 4: about 55 M parameters)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, outputs))
        return nn.Sequential(*layers)
