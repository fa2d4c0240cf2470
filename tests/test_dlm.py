"""lessons/dlm.py: the mask token, LLaDA's 1/p-weighted masked CE against a hand computation, Dream's shift, the
sampler (low-confidence and random remasking), and the outlier-ratio diagnostic."""
import math
import os
import signal
import time

import pytest
import torch

from lessons import dlm
from conftest import ENV, ROOT, TINY, Forked, fails, records, run, start
from model import GPT, GPTConfig


def _ar(seed=0, V=40):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=24)).eval()


def test_mask_token_is_the_vocabulary_mean_and_the_model_becomes_bidirectional():
    ar = _ar()
    m, mask_id = dlm.add_mask_token(ar, "mean")
    assert mask_id == 40 and m.config.vocab_size == 41 and not m.config.causal
    assert torch.equal(m.wte.weight[:40], ar.wte.weight) and m.lm_head.weight is m.wte.weight  # tied: the head too
    assert torch.allclose(m.wte.weight[40], ar.wte.weight.mean(dim=0), atol=1e-7)
    for k, v in ar.state_dict().items():
        if k not in ("wte.weight", "lm_head.weight"):
            assert torch.equal(m.state_dict()[k], v), k
    r, _ = dlm.add_mask_token(ar, "random", seed=1)
    row = r.wte.weight[40]
    assert 0.01 < row.std().item() < 0.03 and not torch.allclose(row, m.wte.weight[40], atol=1e-3)
    x = torch.randint(0, 40, (1, 8))  # bidirectional: changing the last token changes the first position's output
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 40
    with torch.no_grad():
        a, b = (m.forward_with_states(t, hiddens=True)[0][0, 0] for t in (x, y))
    assert not torch.allclose(a, b)


def test_loss_equals_a_hand_computed_inverse_p_weighted_masked_ce():
    m, mask_id = dlm.add_mask_token(_ar(), "mean")
    torch.manual_seed(5)
    x = torch.randint(0, 40, (3, 10))
    t = torch.tensor([[0.2], [0.5], [0.9]])
    masked = torch.rand(3, 10) < t
    loss, _ = dlm.masked_diffusion_loss(m, x, mask_id, t=t, masked=masked)
    inp = torch.where(masked, mask_id, x)
    with torch.no_grad():
        logits = m.forward_with_states(inp, hiddens=True)[0]
    total = 0.0
    for b in range(3):
        p = (1 - 1e-3) * t[b, 0].item() + 1e-3
        for i in range(10):
            if masked[b, i]:
                z = logits[b, i, :mask_id].double()  # the mask id is never a prediction
                total += -(z[x[b, i]] - torch.logsumexp(z, 0)).item() / p
    assert loss.item() == pytest.approx(total / 30, rel=1e-5)


class _Fixed(torch.nn.Module):
    """A 'model' whose logits are a leaf tensor, whatever the input: the loss's gradient shows which count."""
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward_with_states(self, idx, all_logits=False):
        return self.logits, None, {}


def test_unmasked_positions_contribute_nothing_and_the_shift_reads_the_left_neighbour():
    torch.manual_seed(6)
    logits = torch.randn(2, 8, 11, requires_grad=True)
    x = torch.randint(0, 10, (2, 8))
    masked = torch.rand(2, 8) < 0.5
    masked[:, 3] = True
    loss, _ = dlm.masked_diffusion_loss(_Fixed(logits), x, 10, t=torch.full((2, 1), 0.5), masked=masked)
    loss.backward()
    g = logits.grad.abs().sum(-1)
    assert torch.all(g[~masked] == 0) and torch.all(g[masked] > 0)
    assert torch.all(logits.grad[..., 10] == 0)  # nor does the mask id's logit
    shifted = dlm.predictions(_Fixed(logits.detach()), x, 10, shift=True)
    assert torch.equal(shifted[:, 1:, :10], logits.detach()[:, :-1, :10])  # position i reads i - 1
    logits.grad = None
    loss, info = dlm.masked_diffusion_loss(_Fixed(logits), x, 10, t=torch.full((2, 1), 0.5), masked=masked,
                                           shift=True)
    used = info["masked"]
    loss.backward()
    assert not used[:, 0].any() and torch.all(logits.grad[:, -1] == 0)  # position 0 never masked; L-1 unread


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_fills_every_masked_position_never_with_the_mask(temperature, remasking):
    m, mask_id = dlm.add_mask_token(_ar(), "random")
    prompt = torch.randint(0, 40, (1, 5))
    out = dlm.generate(m, prompt, gen_len=16, steps=5, mask_id=mask_id, temperature=temperature,
                       remasking=remasking, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 21) and torch.equal(out[:, :5], prompt) and not (out == mask_id).any()
    with pytest.raises(ValueError, match="block_size"):
        dlm.generate(m, prompt, gen_len=20, steps=4, mask_id=mask_id)
    with pytest.raises(ValueError, match="remasking"):
        dlm.generate(m, prompt, gen_len=4, steps=4, mask_id=mask_id, remasking="lowest")


def test_a_tiny_temperature_samples_the_greedy_fill_and_a_non_finite_or_negative_one_is_refused():
    """Any temperature > 0 samples, even 1e-39, which divides the logits past float32's range (inf - inf = NaN in
    the softmax unless handled): one this small leaves all the probability on the argmax, so one step (every mask
    committed at once) fills in what greedy decoding (temperature 0) does. NaN, -1 (they fail `temperature > 0`)
    and inf (-inf / inf = NaN) are refused, not read as greedy."""
    m, mask_id = dlm.add_mask_token(_ar(), "random")
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = dlm.generate(m, prompt, gen_len=16, steps=1, mask_id=mask_id)
    for temperature in (1e-39, 1e-45, 5e-324):
        out = dlm.generate(m, prompt, gen_len=16, steps=1, mask_id=mask_id, temperature=temperature,
                           generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, greedy), (temperature, out, greedy)
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            dlm.generate(m, prompt, gen_len=4, steps=2, mask_id=mask_id, temperature=temperature)


class _Recording(_Fixed):
    """_Fixed that also keeps the input of every call: the sequence of partly unmasked drafts."""
    def __init__(self, logits):
        super().__init__(logits)
        self.seen, self.config = [], type("C", (), {"block_size": 8})()

    def forward_with_states(self, idx, all_logits=False):
        self.seen.append(idx[0].tolist())
        return super().forward_with_states(idx, all_logits)


def _two_unequally_sure():
    logits = torch.zeros(1, 3, 5)
    logits[0, 1, 2] = 1.0  # position 1: token 2, mildly sure
    logits[0, 2, 3] = 5.0  # position 2: token 3, very sure
    return _Recording(logits)


def test_low_confidence_remasking_commits_the_most_confident_position_first():
    """Two steps, one token each: after step 1 the draft holds the surer position's token, the other still masked."""
    fake = _two_unequally_sure()
    out = dlm.generate(fake, torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4)
    assert fake.seen == [[1, 4, 4], [1, 4, 3]] and out.tolist() == [[1, 2, 3]]



def test_low_confidence_ranks_by_the_untempered_probability_at_any_temperature():
    """LLaDA scores a drawn token by softmax(logits), the temperature only drawing it. Position 1 holds two equal
    logits (either token: probability 0.5, tempered or not), position 2 logits [1.504, 0, 0, 0] (token 0: 0.6, at
    temperature 2 0.414). The first step's draws (replayed from the same generator: softmax(logits / 2), one
    multinomial over the rows) decide which position is committed first: the one whose drawn token has the
    larger untempered probability, so position 2 whenever it drew token 0, which the tempered probabilities
    ranked below position 1 (0.414 < 0.5)."""
    logits = torch.full((1, 3, 5), -30.0)
    logits[0, 1, :2] = 0.0
    logits[0, 2, :4] = torch.tensor([1.504, 0.0, 0.0, 0.0])
    masked = logits.masked_fill(torch.arange(5) == 4, float("-inf"))
    p = torch.softmax(masked, -1)[0]
    tempered = torch.softmax((masked - masked.amax(-1, keepdim=True)) / 2.0, -1)[0]
    second_first = 0
    for seed in range(60):
        fake = _Recording(logits)
        dlm.generate(fake, torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4, temperature=2.0,
                     generator=torch.Generator().manual_seed(seed))
        draws = torch.multinomial(tempered, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        first = 1 if fake.seen[1][1] != 4 else 2
        assert first == (1 if p[1, draws[1]] > p[2, draws[2]] else 2), (seed, draws.tolist(), fake.seen)
        second_first += first == 2
    assert second_first > 10  # token 0 drawn at position 2 (p 0.414 a seed): the case the two rules order apart

def test_random_remasking_commits_positions_in_an_order_blind_to_confidence():
    """Over 100 generator seeds the surer position goes first about half the time (binomial: 50 ± 5), where
    low-confidence remasking puts it first every time."""
    first = 0
    for seed in range(100):
        fake = _two_unequally_sure()
        out = dlm.generate(fake, torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4, remasking="random",
                           generator=torch.Generator().manual_seed(seed))
        assert out.tolist() == [[1, 2, 3]]
        first += fake.seen[1] == [1, 4, 3]
    assert 30 < first < 70, first  # 4 standard deviations


def test_top_k_keeps_sampling_to_the_k_likeliest_tokens():
    """Position 1's logits are nearly flat (token 2 at +1), so sampling at temperature 1 picks another token
    most of the time; top_k=1 leaves only the argmax."""
    picks = {k: [dlm.generate(_two_unequally_sure(), torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4,
                              temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(s))[0, 1].item()
                 for s in range(20)] for k in (None, 1)}
    assert picks[1] == [2] * 20 and len(set(picks[None])) > 1


def test_the_rows_past_the_tokenizers_vocabulary_are_never_drawn(monkeypatch, capsys):
    """A --pad_vocab model has rows past its tokenizer's vocabulary (ids 3 here, the mask 4) that no tokenizer
    decodes (gpt2's raised KeyError, the byte tokenizer dropped them unsaid): with vocab they never win, at any
    temperature, as sample_next's; without it a padding row this likely is drawn. sample.py passes its tokenizer's."""
    logits = torch.zeros(1, 3, 5)
    logits[..., 3] = 4.0  # the padding id, far likelier than 0..2
    for t in (0.0, 1.0):
        got = {tuple(dlm.generate(_Recording(logits), torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4,
                                  temperature=t, vocab=3, generator=torch.Generator().manual_seed(s))[0, 1:].tolist())
               for s in range(20)}
        assert all(i < 3 for ids in got for i in ids), got
    drawn = dlm.generate(_Recording(logits), torch.tensor([[1]]), gen_len=2, steps=2, mask_id=4)
    assert drawn[0, 1:].tolist() == [3, 3]
    import sample
    seen = {}
    monkeypatch.setattr(dlm, "generate", lambda *a, **k: seen.update(k) or torch.zeros(1, 2, dtype=torch.long))
    fake = type("M", (), {"config": type("C", (), {"block_size": 8, "vocab_size": 300})(), "dlm_shift": True})()
    from tokenizer import get_tokenizer
    sample.sample_dlm(fake, get_tokenizer("byte"), dict(start="", max_new_tokens=2, seed=0, num_samples=1, steps=2,
                                                        temperature=1.0, top_k=None, remasking="random"), "cpu")
    assert seen["vocab"] == 257


def _flat(gen_len, hot=None):
    """A _Recording of 1 + gen_len positions over tokens 0..3 (4 is the mask): all logits 0, or token `hot` at +1."""
    logits = torch.zeros(1, 1 + gen_len, 5)
    if hot is not None:
        logits[..., hot] = 1.0
    fake = _Recording(logits)
    fake.config.block_size = 1 + gen_len
    return fake


@pytest.mark.parametrize("gen_len, steps, masks_seen", [(7, 3, [7, 4, 2]), (10, 4, [10, 7, 4, 2]), (2, 4, [2, 1])])
def test_sampler_commits_the_ceiling_of_masks_left_over_steps_left(gen_len, steps, masks_seen):
    """k = ceil(left / (steps - s)): 7 masks in 3 steps go 3, 2, 2 (the model sees 7, 4, 2 masks); 2 masks in 4 steps
    take 2 calls, one token each, and the sampler stops when none is left (a floor commits 2, 2, 3 and 0, 0, 1, 1)."""
    fake = _flat(gen_len)
    out = dlm.generate(fake, torch.tensor([[1]]), gen_len=gen_len, steps=steps, mask_id=4)
    assert [draft.count(4) for draft in fake.seen] == masks_seen and not (out == 4).any()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_follows_the_softmax_of_logits_over_temperature(temperature):
    """Logits (0, 1, 0, 0) at every position: token 1 is drawn with probability e^(1/T) / (e^(1/T) + 3), 0.711 at
    T = 0.5 and 0.355 at T = 2 (0.475 if T were ignored); 1000 draws (20 seeds x 50 positions) land within 4
    binomial standard deviations (about 0.06)."""
    picks = []
    for seed in range(20):
        out = dlm.generate(_flat(50, hot=1), torch.tensor([[1]]), gen_len=50, steps=1, mask_id=4,
                           temperature=temperature, generator=torch.Generator().manual_seed(seed))
        picks += out[0, 1:].tolist()
    p = math.exp(1 / temperature) / (math.exp(1 / temperature) + 3)
    assert abs(picks.count(1) / len(picks) - p) < 4 * math.sqrt(p * (1 - p) / len(picks)), (picks.count(1), p)


def test_outlier_ratio_sees_a_random_mask_row_as_an_outlier_after_rmsnorm():
    """The diagnostic splits mask tokens from the others, and flags a spiky row: a one-hot mask embedding has, after
    the first RMSNorm, max|y| / mean|y| = n_embd, far above a dense row's."""
    m, mask_id = dlm.add_mask_token(_ar(), "mean")
    x = torch.randint(0, 40, (2, 12))
    x[:, ::3] = mask_id
    mask_r, other_r = dlm.outlier_ratio(m, x, mask_id)
    assert math.isfinite(mask_r) and math.isfinite(other_r) and mask_r > 1 and other_r > 1
    with torch.no_grad():  # a one-hot mask row: after RMSNorm max|y| / mean|y| = C at the first layer
        m.wte.weight[mask_id] = 0.0
        m.wte.weight[mask_id, 0] = 1.0
    spiky, _ = dlm.outlier_ratio(m, x, mask_id)
    assert spiky > 2 * mask_r


# ----------------------------------------------------------------------------- train.py --stage=dlm, sample.py --dlm



@pytest.fixture(scope="module")
def stage2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dlm") / "o")
    run(f"--out_dir={out}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=6", "--eval_interval=6")
    return out


def _steps(out, name):
    return {r["step"]: r["loss"] for r in records(out, run_name=name) if "loss" in r}


@pytest.mark.slow
def test_stage_dlm_converts_logs_its_diagnostics_and_resumes_bit_exactly(stage2, tmp_path):
    ckpt = os.path.join(stage2, "stage2", "ckpt.pt")
    args = ["--stage=dlm", f"--init_from={ckpt}", *TINY, "--max_iters=8", "--eval_interval=8",
            "--checkpoint_interval=4"]
    straight, halves = str(tmp_path / "a"), str(tmp_path / "b")
    p = run(f"--out_dir={straight}", *args)
    assert "mask token (id 257, mean init)" in p.stdout and "(dlm, 8 steps)" in p.stdout
    recs = [r for r in records(straight, run_name="dlm") if "loss" in r]
    assert len(recs) == 8 and all(r["ratio_mask"] > 1 and r["ratio_other"] > 1 for r in recs)
    assert recs[0]["lambda"] == 0.0  # the conversion warms lambda up again (--lambda_warmup_steps)
    log = str(tmp_path / "b.log")
    p = start(f"--out_dir={halves}", *args, log=log, faults="hang_at=4")  # killed after the step-4 checkpoint
    deadline = time.time() + 120
    while "hanging until killed" not in open(log).read() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert "at step 4" in run(f"--out_dir={halves}", "--stage=dlm", "--resume=True").stdout
    a, b = _steps(straight, "dlm"), _steps(halves, "dlm")
    assert sorted(a) == sorted(b) == list(range(1, 9)) and [a[s] for s in a] == [b[s] for s in a]
    p = Forked([os.path.join(ROOT, "sample.py"), "--dlm=True", f"--ckpt={straight}/dlm/ckpt.pt",
                "--max_new_tokens=20", "--steps=5", "--num_samples=1"], ENV)  # forked with the imports done
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0 and stdout.count("---------------") == 1, stderr


@pytest.mark.slow
def test_stage_dlm_says_it_runs_eagerly_under_compile(stage2, tmp_path):
    """Its loss calls the model itself (with the outlier-ratio hooks), never the compiled one: a run asked to
    compile says it runs eagerly and reports compile off, where it said compile on and ran eager."""
    p = run(f"--out_dir={tmp_path}", "--stage=dlm", f"--init_from={os.path.join(stage2, 'stage2', 'ckpt.pt')}",
            *TINY, "--max_iters=1", "--eval_interval=1", "--compile=true")
    assert "--stage=dlm runs eagerly" in p.stdout and "compile off" in p.stdout, p.stdout


def test_stage_dlm_refuses_a_missing_source_and_torchrun(tmp_path, capsys, monkeypatch):
    line = fails(capsys, "--stage=dlm", f"--out_dir={tmp_path}", *TINY)
    assert "converts a trained ternary model" in line and "--stage=2" in line
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "one process" in fails(capsys, "--stage=dlm", f"--out_dir={tmp_path}", *TINY, "--grad_accum=2", code=2)


@pytest.mark.parametrize("scale", [0.02, 0.5])
def test_a_random_mask_row_is_drawn_at_the_scale_asked(scale):
    """lab.mask_outliers draws the random row at a pretrained embedding's own scale (SmolLM2's std is not our 0.02)."""
    model, mask_id = dlm.add_mask_token(_ar(), "random", seed=3, scale=scale)
    row = model.wte.weight[mask_id]
    assert abs(row.std().item() / scale - 1) < 0.35 and torch.equal(model.lm_head.weight[mask_id], row)


@pytest.mark.slow
def test_mask_outliers_measures_each_mask_row_on_a_pretrained_model(tmp_path, capsys):
    """python -m lab.mask_outliers on a tiny Llama (tests/imported.py's, no download): one (mask, other) ratio per
    mask row, each the toy table's statistic (dlm.outlier_ratio) computed on the model as published plus that row;
    bad flags are one line."""
    import json
    from imported import tiny_llama
    from lab import mask_outliers
    src = tiny_llama(str(tmp_path / "tiny_llama"))
    out = str(tmp_path / "r.json")
    assert mask_outliers.main([f"--model={src}", "--windows=2", "--block_size=32", f"--out={out}"]) == 0
    res = json.load(open(out))
    assert len(res["ratios"]) == 3 and res["windows"] == 2
    for r in res["ratios"].values():  # max|y| / mean|y| of a token: >= 1, and at most its width (64)
        assert 1 <= r["mask"] <= 64 and 1 <= r["other"] <= 64, r
    assert len({round(r["mask"], 6) for r in res["ratios"].values()}) == 3  # each row is its own token
    capsys.readouterr()  # transformers' progress bars so far
    assert "--t=1.0" in fails(capsys, f"--model={src}", "--t=1.0", code=2, main=mask_outliers.main)
    assert "--model=x.pt" in fails(capsys, "--model=x.pt", code=2, main=mask_outliers.main)
