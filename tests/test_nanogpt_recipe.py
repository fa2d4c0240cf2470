"""
README's "Using these files in nanoGPT", run: the recipe applied to a nanoGPT-shaped model and
training loop.

nanoGPT's model.py is lab/nanogpt.py (the repository's one copy: GPTConfig(bias), c_attn, c_proj,
c_fc, ln_1, ln_2, transformer.wte/wpe/h/ln_f, lm_head tied to wte, configure_optimizers); below, the
recipe's edits of it and nanoGPT's train.py cut down to what the recipe touches (get_lr, the
GradScaler, the checkpoint dict and resume). Every line the recipe changes ends in a "# recipe:"
comment; the rest is nanoGPT's. The tests check that with the recipe
  - Muon gets exactly the c_attn/c_proj/c_fc weights, and AdamW wte (= lm_head, once), wpe, norms
    and biases;
  - the schedule line keeps Muon at 0.02 x get_lr's multiplier (nanoGPT's `param_group['lr'] = lr`
    would not);
  - 80 steps on the shipped corpus (byte shards) take the val loss more than 1 nat below an
    untrained model's;
  - a run resumed from its step-50 checkpoint (model, optimizer, zclip, iter_num) equals the
    uninterrupted run bit for bit, and an fp16-style GradScaler hands ZClip and the optimizer the
    same gradients as none (up to subnormals).
Not nanoGPT, and not the recipe: batches come from data.DataLoader, whose position the checkpoint
also stores (nanoGPT's get_batch draws from the global torch RNG, which its checkpoint does not
save, so its own resume is not bitwise); estimate_loss reads the same val batches each time;
torch.amp.GradScaler('cuda', ...) for the deprecated torch.cuda.amp.GradScaler(...); no dropout,
flash attention only, no from_pretrained, crop_block_size, DDP, autocast or torch.compile.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_nanogpt_recipe.py
"""

import json
import math
import os
import shutil

import pytest
import torch

from tools import config, loaders
import data
from lab import nanogpt
from lab.nanogpt import GPTConfig
from muon import configure_muon, ns_dtype_for  # recipe: new import
from quant import BitLinear, set_lambda  # recipe: new import
from zclip import ZClip  # recipe: new import

# -----------------------------------------------------------------------------
# model.py: nanoGPT's, from lab/nanogpt.py (the one copy in this repository); the recipe's two edits
# of it


class GPT(nanogpt.GPT):
    """nanoGPT's GPT with the recipe: each block's four nn.Linear a BitLinear, Muon in
    configure_optimizers."""

    def __init__(self, config):
        super().__init__(config, linear=BitLinear)  # recipe: was nn.Linear in attention and MLP

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return configure_muon(self, muon_lr=0.02, adamw_lr=learning_rate,  # recipe: the whole body
                              muon_weight_decay=weight_decay, adamw_weight_decay=weight_decay, adamw_betas=betas,
                              fused=device_type == 'cuda',
                              ns_dtype=ns_dtype_for(device_type))


# -----------------------------------------------------------------------------
# train.py: config/train_shakespeare_char.py's values, shrunk to a few seconds on one CPU core

eval_interval = 50  # the one checkpoint of an 80-step run is written at iter 50
eval_iters = 8
batch_size = 12
block_size = 64
n_layer, n_head, n_embd, bias = 2, 4, 64, False
learning_rate = 1e-3  # max learning rate: AdamW's; Muon's is configure_optimizers' 0.02, scaled alike
max_iters = 80
lambda_warmup_iters = 40  # recipe: lambda 0 -> 1 over these iterations (our CPU preset: 600)
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.99
decay_lr = True
warmup_iters = 10
lr_decay_iters = 80
min_lr = 1e-4
device = 'cpu'
dtype = 'float32'  # nanoGPT: 'bfloat16' or 'float16'; on a CPU its GradScaler is off either way
device_type = 'cuda' if 'cuda' in device else 'cpu'


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def sources():
    """The shipped corpus as byte shards (tokenised on first use) and its vocab size, as nanoGPT's meta.pkl."""
    src = loaders.resolve_data(config.TrainConfig(tokenizer="byte"))
    with open(os.path.join(next(iter(src)), "meta.json")) as f:
        return src, json.load(f)["vocab_size"]


def init(init_from, out_dir):
    """nanoGPT's init section: model ('scratch' or 'resume' from out_dir/ckpt.pt), GradScaler,
    optimizer; and ZClip. Returns (model, optimizer, zclip, scaler, train_loader, iter_num)."""
    torch.manual_seed(1337)
    src, meta_vocab_size = sources()
    iter_num = 0
    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                      vocab_size=meta_vocab_size)
    if init_from == 'resume':
        checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location=device)
        model_args = checkpoint['model_args']
    model = GPT(GPTConfig(**model_args))
    if init_from == 'resume':
        model.load_state_dict(checkpoint['model'])
        iter_num = checkpoint['iter_num']
    model.to(device)
    # initialize a GradScaler. If enabled=False scaler is a no-op
    scaler = torch.amp.GradScaler('cuda', enabled=(dtype == 'float16'))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
    zclip = ZClip()  # recipe: right after configure_optimizers, before the resume block
    train_loader = data.DataLoader(src, 'train', batch_size, block_size, order='sequential')
    if init_from == 'resume':
        optimizer.load_state_dict(checkpoint['optimizer'])
        zclip.load_state_dict(checkpoint['zclip'])  # recipe: ZClip is not an optimizer
        train_loader.load_state_dict(checkpoint['loader'])
    return model, optimizer, zclip, scaler, train_loader, iter_num


@torch.no_grad()
def estimate_loss(model, val_loader):
    val_loader.reset()  # the same eval_iters batches every time
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        X, Y = val_loader.next_batch()
        logits, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean().item()


def train(model, optimizer, zclip, scaler, train_loader, iter_num, out_dir, stop_iter=max_iters):
    """nanoGPT's training loop from iter_num through stop_iter (its max_iters), writing
    out_dir/ckpt.pt at each eval. Returns ({iter: train loss}, {iter: val loss})."""
    val_loader = data.DataLoader(sources()[0], 'val', batch_size, block_size, order='sequential')
    train_losses, val_losses = {}, {}
    while True:
        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = param_group['initial_lr'] * lr / learning_rate  # recipe: was = lr
        set_lambda(model, min(1.0, iter_num / lambda_warmup_iters))  # recipe: the lambda warm-up
        # evaluate the loss on the val set and write checkpoints
        if iter_num % eval_interval == 0:
            val_losses[iter_num] = estimate_loss(model, val_loader)
            if iter_num > 0:
                checkpoint = {
                    'model': model.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'zclip': zclip.state_dict(),  # recipe: ZClip's statistics
                    'model_args': dict(vars(model.config)),
                    'iter_num': iter_num,
                    'loader': train_loader.state_dict(),  # not nanoGPT: see the docstring
                }
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
        # forward backward update, with gradient scaling if training in fp16
        X, Y = train_loader.next_batch()
        logits, loss = model(X, Y)
        scaler.scale(loss).backward()
        # clip the gradient
        scaler.unscale_(optimizer)  # recipe: in place of the clip_grad_norm_ block
        zclip.clip(model)  # recipe: was clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        # flush the gradients as soon as we can, no need for to keep that memory around
        optimizer.zero_grad(set_to_none=True)
        train_losses[iter_num] = loss.item()
        iter_num += 1
        if iter_num > stop_iter:
            break
    return train_losses, val_losses


# -----------------------------------------------------------------------------
# the tests


def same(a, b):
    """a and b equal bit for bit: tensors (dtype included), and dicts, lists and plain values holding them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One 80-step run from scratch; its out_dir keeps the step-50 checkpoint."""
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    model, optimizer, zclip, scaler, train_loader, iter_num = init('scratch', out_dir)
    train_losses, val_losses = train(model, optimizer, zclip, scaler, train_loader, iter_num, out_dir)
    final_val = estimate_loss(model, data.DataLoader(sources()[0], 'val', batch_size, block_size,
                                                     order='sequential'))
    return dict(out_dir=out_dir, model=model, optimizer=optimizer, zclip=zclip, train_losses=train_losses,
                val_losses=val_losses, final_val=final_val)


@pytest.mark.parametrize("bias", [False, True])
def test_muon_gets_exactly_the_hidden_matrices_and_adamw_the_rest(bias):
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, bias=bias))
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cpu')
    names = {id(p): n for n, p in model.named_parameters()}  # the tied weight appears once, as wte
    muon = [names[id(p)] for g in optimizer.param_groups if g['kind'] == 'muon' for p in g['params']]
    decay, no_decay = ([names[id(p)] for p in g['params']] for g in optimizer.param_groups if g['kind'] == 'adamw')
    hidden = [n for n in names.values() if n.endswith(('c_attn.weight', 'c_proj.weight', 'c_fc.weight'))]
    assert sorted(muon) == sorted(hidden) and len(hidden) == 4 * 2
    assert sorted(decay) == ['transformer.wpe.weight', 'transformer.wte.weight']
    assert model.lm_head.weight is model.transformer.wte.weight  # so lm_head is in AdamW once, as wte
    norms = [n for n in names.values() if '.ln_' in n or n.startswith('transformer.ln_f')]
    biases = [n for n in names.values() if n.endswith('.bias')]
    assert sorted(no_decay) == sorted(set(norms + biases))
    assert len(biases) == (4 * 2 + 2 * 2 + 1 if bias else 0)  # Linear biases, ln_1/ln_2, ln_f
    assert len(muon) + len(decay) + len(no_decay) == len(names)  # every parameter once
    lr_wd = [(g['initial_lr'], g['weight_decay']) for g in optimizer.param_groups]
    assert lr_wd == [(0.02, 0.1), (6e-4, 0.1), (6e-4, 0.0)]


def test_schedule_line_keeps_muon_at_its_own_lr_times_the_multiplier(tmp_path):
    model, optimizer, zclip, scaler, train_loader, _ = init('scratch', tmp_path)
    it = 30  # in the cosine decay, between evals
    train(model, optimizer, zclip, scaler, train_loader, it, tmp_path, stop_iter=it)  # one iteration
    lr = get_lr(it)
    mult = lr / learning_rate
    muon_lr = optimizer.param_groups[0]['lr']
    assert muon_lr == pytest.approx(0.02 * mult, rel=1e-12)
    assert muon_lr != pytest.approx(lr)  # what nanoGPT's `param_group['lr'] = lr` would have left there
    assert [g['lr'] for g in optimizer.param_groups[1:]] == pytest.approx([lr, lr], rel=1e-12)
    lambdas = {m.lambda_.item() for m in model.modules() if isinstance(m, BitLinear)}
    assert lambdas == {it / lambda_warmup_iters}  # the warm-up line, read from iter_num: 0.75


@pytest.mark.slow
def test_recipe_learns_the_shipped_corpus(uninterrupted):
    untrained, final = uninterrupted['val_losses'][0], uninterrupted['final_val']
    assert untrained == pytest.approx(math.log(257), abs=0.2)  # byte tokens: 256 bytes and the EOT id
    assert final < untrained - 1.0, (untrained, uninterrupted['val_losses'], final)
    bit = [m for m in uninterrupted['model'].modules() if isinstance(m, BitLinear)]
    assert bit and {m.lambda_.item() for m in bit} == {1.0}  # ternary by the end of the warm-up


def test_resume_from_checkpoint_continues_bit_for_bit(uninterrupted, tmp_path):
    shutil.copy(os.path.join(uninterrupted['out_dir'], 'ckpt.pt'), tmp_path)
    model, optimizer, zclip, scaler, train_loader, iter_num = init('resume', tmp_path)
    assert iter_num == eval_interval
    train_losses, val_losses = train(model, optimizer, zclip, scaler, train_loader, iter_num, tmp_path)
    ref = uninterrupted
    assert train_losses == {i: l for i, l in ref['train_losses'].items() if i >= iter_num}
    assert val_losses == {iter_num: ref['val_losses'][iter_num]}
    assert same(model.state_dict(), ref['model'].state_dict())
    assert same(optimizer.state_dict(), ref['optimizer'].state_dict())
    assert same(zclip.state_dict(), ref['zclip'].state_dict())  # a fresh ZClip would still be in warmup


def test_fp16_style_grad_scaler_unscales_before_zclip_and_step(tmp_path):
    runs = []
    for scaler in (None, torch.amp.GradScaler('cpu', init_scale=2.0 ** 16)):  # CPU: fp32 loss, scaled
        model, optimizer, zclip, off, train_loader, _ = init('scratch', tmp_path)
        train(model, optimizer, zclip, scaler or off, train_loader, 1, tmp_path, stop_iter=3)
        runs.append((model.state_dict(), zclip.state_dict()))
    # Scaling by 2**16 and unscaling is exact except for gradients below fp32's normal range, which
    # the unscaled
    # run keeps as subnormals or flushes to zero depending on the process's FTZ/DAZ state (a library
    # loaded
    # earlier in the same process can set it). Without unscale_ ZClip's statistics would be 2**16
    # times larger.
    (w0, z0), (w1, z1) = runs
    assert w0.keys() == w1.keys() and all(torch.allclose(w0[k], w1[k], rtol=1e-6, atol=1e-12) for k in w0)
    for k in ("mean", "var", "warmup_norms"):
        assert torch.allclose(z0[k], z1[k], rtol=1e-5, atol=0), (k, z0[k], z1[k])
