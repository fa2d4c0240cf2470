"""Tests for lessons/averaging.py (checkpoint averaging, Luo et al. arXiv 2511.18903) and its use in train.py:
the average equals the hand-computed weighted sum of the snapshots, the model gets its own weights back,
train.py's avg.pt is that average of its own numbered checkpoints, resumes exactly, and sample.py loads it.
Run: python -m pytest tests/test_averaging.py"""

import os
import shutil

import pytest
import torch

from lessons.averaging import CheckpointAverage
from conftest import ROOT, TINY, ENV, Forked, records, run


def _snapshots(k, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    seen = []
    avg = CheckpointAverage(k=k, interval=2, alpha=ALPHA, last_step=steps)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # a "training step"
        avg.update(model, step)
        if step in avg.steps():
            seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return model, avg, seen


ALPHA = 0.2


@pytest.mark.parametrize("alpha", [0.2, 0.0])
def test_average_is_the_hand_computed_ema_or_mean_of_the_snapshots(alpha, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ALPHA", alpha)
    k = 4
    model, avg, seen = _snapshots(k, steps=11)
    assert avg.steps() == [5, 7, 9, 11] and avg.count == k == len(seen)
    # closed form: theta_1 weighs (1 - a)^(k-1), theta_i (i >= 2) a (1 - a)^(k-i); a = 0: 1/k each
    w = [1 / k] * k if alpha == 0 else [(1 - alpha) ** (k - 1)] + [alpha * (1 - alpha) ** (k - i) for i in range(2, k + 1)]
    assert sum(w) == pytest.approx(1.0)
    for n, p in model.named_parameters():
        expected = sum(wi * s[n] for wi, s in zip(w, seen))
        torch.testing.assert_close(avg.avg[n], expected, rtol=1e-6, atol=1e-6)


def test_swapped_in_holds_the_average_and_gives_the_weights_back():
    model, avg, seen = _snapshots(3, steps=9)
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    with avg.swapped_in(model):
        assert all(torch.equal(p, avg.avg[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError):
        CheckpointAverage(k=0)


@pytest.mark.slow
def test_train_saves_the_average_of_its_own_checkpoints_resumes_it_exactly_and_sample_loads_it(tmp_path):
    """avg.pt of a ternary run = the EMA of the latent weights of the numbered checkpoints at its snapshot
    steps; a run stopped at step 8 and resumed ends with the same avg.pt; val_loss_avg is logged."""
    out, out2 = str(tmp_path / "a"), str(tmp_path / "b")
    args = [*TINY, "--stage=2", "--init_from=scratch", "--avg_checkpoints=3", "--avg_interval=2",
            "--eval_interval=5", "--checkpoint_interval=1", "--keep_last=20"]
    run(*args, "--max_iters=10", f"--out_dir={out}")
    d = os.path.join(out, "stage2")
    avg = torch.load(os.path.join(d, "avg.pt"), weights_only=True)
    assert avg["averaged"]["steps"] == [6, 8, 10] and avg["step"] == 10
    snaps = [torch.load(os.path.join(d, f"ckpt_{s:06d}.pt"), weights_only=True)["model"] for s in (6, 8, 10)]
    for name, t in avg["model"].items():
        if t.is_floating_point() and "rope" not in name and "lam" not in name:
            expected = 0.8 ** 2 * snaps[0][name] + 0.2 * 0.8 * snaps[1][name] + 0.2 * snaps[2][name]
            torch.testing.assert_close(t, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(avg["model"]["lm_head.weight"], snaps[2]["lm_head.weight"])
    recs = [r for r in records(out) if "val_loss" in r]
    assert "val_loss_avg" not in recs[0] and "val_loss_avg" in recs[-1]  # step 5: no snapshot yet
    os.makedirs(os.path.join(out2, "stage2"))  # resume the same run from its step-8 checkpoint (2 snapshots in)
    shutil.copy(os.path.join(d, "ckpt_000008.pt"), os.path.join(out2, "stage2", "ckpt.pt"))
    run("--resume=True", "--stage=2", f"--out_dir={out2}")
    again = torch.load(os.path.join(out2, "stage2", "avg.pt"), weights_only=True)
    assert all(torch.equal(again["model"][n], t) for n, t in avg["model"].items())
    p = Forked([os.path.join(ROOT, "sample.py"), f"--ckpt={os.path.join(d, 'avg.pt')}", "--max_new_tokens=8",
                "--num_samples=1", "--device=cpu"], ENV)  # `python sample.py`, forked with the imports done
    assert p.wait(timeout=120) == 0, p.communicate()[1]


def test_a_resumed_running_mean_equals_the_uninterrupted_one():
    """alpha = 0 is the plain mean, whose next weight 1/(count + 1) needs the count of snapshots so far: an average
    saved after 2 of 4 snapshots and loaded into a fresh CheckpointAverage ends on the same mean (1/4 each), not on
    one that weighs the resumed snapshots as if they were the first."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    thetas = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(4)]

    def step_to(avg, i):  # the weights after step 2 * (i + 1): snapshot i of 4
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(thetas[i][n])
        avg.update(model, 2 * (i + 1))

    first = CheckpointAverage(k=4, interval=2, alpha=0.0, last_step=8)
    for i in range(2):
        step_to(first, i)
    resumed = CheckpointAverage(k=4, interval=2, alpha=0.0, last_step=8)
    resumed.load_state_dict(first.state_dict())
    for i in range(2, 4):
        step_to(resumed, i)
    for n, _ in model.named_parameters():
        torch.testing.assert_close(resumed.avg[n], sum(t[n] for t in thetas) / 4, rtol=1e-6, atol=1e-6)
    assert resumed.count == 4
