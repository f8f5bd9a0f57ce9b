"""The built-in models: a nanoGPT-style causal language model (pre-norm transformer; input and
output embeddings tied or not, `model.tie_embeddings`) and a small text classifier; and `build_model` for every model kind
(`hf` models live in workers/training/hf.py).

Every model answers `model(ids, targets)` with `(logits, loss)`: the loop needs nothing else."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from api_schemas import HFModelConfig, MLPConfig, ModelConfig
from workers.training.hf import build_hf_model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = F.linear(x, self.qkv.weight, _without_key_gradient(self.qkv.bias, C)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


def _without_key_gradient(bias: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """The q, k, v bias with no gradient into its key part. A key's bias adds the same amount to all
    of a query's scores, which the softmax takes away: its true gradient is 0, and what autograd
    computes is float noise, which Adam scales up to steps of the learning rate's size (so two
    processes no longer trained the weights of one). Detached, it keeps its initial value."""
    if bias is None:
        return None
    return torch.cat([bias[:width], bias[width : 2 * width].detach(), bias[2 * width :]])


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int):
        super().__init__()
        self.config, self.vocab_size = config, vocab_size
        self.wte = nn.Embedding(vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # A tied head is GPT-2's, without a bias; an untied one has a bias as every other layer does.
        self.lm_head = nn.Linear(config.n_embd, vocab_size, bias=config.bias and not config.tie_embeddings)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
            # The tied weight is saved once, as wte.weight, and loaded back into both names: a state
            # dict with two names of one storage makes safetensors (and Accelerate) drop one with a warning.
            self._register_state_dict_hook(_without_tied_head)
            self._register_load_state_dict_pre_hook(_with_tied_head)
        if config.init == "gpt2":
            self.apply(self._init_weights)
            # Scaled init of residual projections (GPT-2 paper).
            for name, param in self.named_parameters():
                if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                    nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for every position, and the mean cross-entropy if `targets` is given."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def _without_tied_head(model: GPT, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    del state_dict[f"{prefix}lm_head.weight"]


def _with_tied_head(state_dict: dict, prefix: str, *_) -> None:
    if f"{prefix}wte.weight" in state_dict:
        state_dict.setdefault(f"{prefix}lm_head.weight", state_dict[f"{prefix}wte.weight"])


class MLPClassifier(nn.Module):
    """Mean of the text's token embeddings (padding left out), then an MLP to one logit per label."""

    def __init__(self, config: MLPConfig, vocab_size: int):
        super().__init__()
        self.config, self.pad_id = config, vocab_size
        self.embed = nn.Embedding(vocab_size + 1, config.n_embd, padding_idx=vocab_size)
        layers, width = [], config.n_embd
        for _ in range(config.n_layer):
            layers += [nn.Linear(width, config.hidden), nn.GELU(), nn.Dropout(config.dropout)]
            width = config.hidden
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(width, config.num_labels)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits per text, and the mean cross-entropy if `targets` (label ids) is given."""
        keep = (idx != self.pad_id).unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(idx) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        logits = self.head(self.mlp(pooled))
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss


def build_model(config: ModelConfig | MLPConfig | HFModelConfig, vocab_size: int, data_root: Path | None = None) -> nn.Module:
    """A fresh model for a tokenizer of `vocab_size` ids; `data_root` holds an `hf` model's `path`."""
    if config.kind == "hf":
        return build_hf_model(config, vocab_size, data_root)
    return GPT(config, vocab_size) if config.kind == "gpt" else MLPClassifier(config, vocab_size)
