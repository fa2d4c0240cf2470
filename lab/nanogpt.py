"""
nanoGPT's model (github.com/karpathy/nanoGPT, model.py), the one baseline of every comparison here
that needs a nanoGPT shape: lab/bench_train.py (step time, the work of a step, profiles),
lab/bench_profile.py (where the CPU step's time goes), lab/bench_quality.py (time to quality) and
tests/test_nanogpt_recipe.py (our recipe applied to nanoGPT). Real nanoGPT itself, its train.py included, is run only by lab/against_nanogpt.py.

nanoGPT's names, structure and initialisation: GPTConfig(bias), Block(ln_1, attn(c_attn, c_proj),
ln_2, mlp(c_fc, gelu, c_proj)), GPT(transformer.wte/wpe/h/ln_f, lm_head tied to wte), N(0, 0.02)
weights, zero biases, residual projections (c_proj) N(0, 0.02 / sqrt(2 n_layer)), and
configure_optimizers (AdamW, weight decay on the matrices only). Left out: dropout, from_pretrained,
crop_block_size, generate, estimate_mfu.

The one hook: GPT(config, linear=nn.Linear) builds the four projections of each block with `linear`;
the recipe (README's "Using these files in nanoGPT") passes quant.BitLinear there, as an edit of
nanoGPT's model.py would.

    from lab.nanogpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=257, block_size=256, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)

Test: python -m pytest tests/test_nanogpt_recipe.py tests/test_bench.py
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257, padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2; False: a bit better and faster


class CausalSelfAttention(nn.Module):
    def __init__(self, config, linear=nn.Linear):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k, v in one matmul
        self.c_attn = linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)  # (B,nh,T,hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config, linear=nn.Linear):
        super().__init__()
        self.c_fc = linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config, linear=nn.Linear):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, linear)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, linear)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, linear=nn.Linear):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config, linear) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # full precision
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):  # a quant.BitLinear is an nn.Linear too
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: the last position's logits only
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """nanoGPT's AdamW: weight decay on every parameter of 2 or more dimensions (matrices,
        embeddings), none on norms and biases; the fused kernel on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]  # the tied weight once
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)
