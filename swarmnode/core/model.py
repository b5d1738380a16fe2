"""A small decoder-only GPT (its shapes are `presets.py`) and device selection.

No dropout, so a step depends only on the weights and the batch,
which keeps CPU training bitwise repeatable under `configure_determinism`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmnode.core.device_choice import check_device_choice
from swarmnode.core.presets import ModelConfig
from swarmnode.util.errors import ConfigError


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * self.cfg.n_layer)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens exceeds the model's context {self.cfg.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(inputs), targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [batch, time, vocab] logits against [batch, time] targets, in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(cfg: ModelConfig, seed: int, device: torch.device) -> GPT:
    """The initial weights are a pure function of (cfg, seed): every node of a run starts identical."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = GPT(cfg)
    torch.random.set_rng_state(generator_state)
    return model.to(device)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def select_device(choice: str) -> torch.device:
    """`auto`: cuda when available, else cpu; `cuda` or `cuda:N` without that GPU is a usage error
    (ConfigError naming --device), as is a value that names no device."""
    try:
        check_device_choice(choice)
    except ValueError as exc:
        raise ConfigError(f"--device: {exc}, got {choice!r}") from None
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(choice)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"--device: no CUDA device is available here, got {choice!r}")
    if device.index is not None and device.index >= count:
        raise ConfigError(f"--device: this machine has {count} CUDA device(s), from cuda:0, got {choice!r}")
    return device


def configure_determinism(device: torch.device, threads: int | None) -> None:
    """Bitwise-repeatable CPU training: deterministic kernels and a fixed thread count."""
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
