"""A GPT-style byte-level language model in plain PyTorch: 256 byte tokens, learned positions, pre-norm blocks of
causal self-attention and an MLP, the output head tied to the token embedding. No gpuswarm import, so a
downloaded model loads with this file alone."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256  # one token per byte


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, context: int = 128, d_model: int = 192, n_layer: int = 3, n_head: int = 6,
                 dropout: float = 0.0):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.context = context
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        # GPT-2's scaling of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, 256) of the next byte after each position of `tokens` (batch, time <= context)."""
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens are more than the model's context of {self.context}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, prompt: bytes, n: int, temperature: float = 0.8, seed: int = 0) -> bytes:
        """`n` more bytes after `prompt`, sampled (for a look at what the model learned)."""
        device = self.tok.weight.device
        generator = torch.Generator(device=device).manual_seed(seed)
        tokens = torch.tensor([list(prompt) or [10]], dtype=torch.long, device=device)
        for _ in range(n):
            logits = self(tokens[:, -self.context:])[:, -1].float() / max(temperature, 1e-6)
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return bytes(tokens[0, len(prompt) or 1:].tolist())
