"""End-to-end tests of train.py on the shipped corpus (tiny models, CPU) and of its schedules and CLI."""

import dataclasses
import json
import math
import os
import re

import pytest
import torch

import train
from tools import checks, config, loaders, metrics, seams, start
from zclip import ZClip
from conftest import ROOT, TINY, fails, records, run, small_corpus

BIGGER = [*TINY, "--batch_size=8", "--eval_iters=4"]  # enough tokens per step to see stage 1 learn in 60 steps


@pytest.mark.slow
def test_unknown_cli_key_fails_with_the_list_of_valid_keys():
    p = run("--stage=2", "--learning_rate=1e-3", rc=2)  # as a user runs it: one line, no traceback
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "--learning_rate=1e-3" in err[0] and "lr" in err[0] and "max_iters" in err[0]


@pytest.mark.parametrize("flag,facts", [("--max_iters=ten", ("--max_iters=ten", "int")),
                                        ("--stage=7", ("--stage=7", "1, 2, 3 or dlm"))])
def test_wrong_type_and_bad_stage_fail_clearly(capsys, flag, facts):
    msg = fails(capsys, flag, code=2)
    assert all(f in msg for f in facts), msg


@pytest.mark.parametrize("flag,facts", [
    ("--n_head=0", (">= 1",)), ("--n_head=-2", (">= 1",)), ("--n_embd=0", (">= 1",)), ("--n_layer=0", (">= 1",)),
    ("--block_size=-8", (">= 1",)), ("--block_size=0", (">= 1",)), ("--max_iters=-5", (">= 0",)),
    ("--lr=nan", ("> 0",)), ("--lr=-1", ("> 0",)), ("--lr=inf", ("finite",)), ("--muon_lr=-1", ("> 0",)),
    ("--muon_lr=nan", ("> 0",)), ("--beta1=1.5", ("[0, 1)",)), ("--weight_decay=-0.1", (">= 0",)),
    ("--min_lr_frac=-3", ("[0, 1]",)), ("--decay_frac=2", ("[0, 1]",)), ("--warmup_steps=-1", (">= 0",)),
    ("--two_phase_lr_drop=-5", ("(0, 1]",)), ("--zclip_z_thresh=-1", ("> 0",)), ("--seed=-1", (">= 0",)),
    ("--distill_tau=0", ("> 0",)), ("--distill_relation_heads=0", (">= 1",)),
    ("--tokenizer=foo", ("byte", "gpt2")), ("--dtype=float17", ("bfloat16",)), ("--compile=maybe", ("auto",)),
    ("--device=cuda:99", ("cuda",)), ("--device=tpu", ("cpu",)),
    ("--data=a:inf", ("a:inf", "weight")), ("--data=a:abc", ("a:abc", "weight")),
    ("--data=a:0.5,b", ("every source a weight",)),
    # a path, not a name: it wrote the run (and --overwrite's removal) outside --out_dir
    ("--run_name=a/b/../../..", ("one directory inside --out_dir",)), ("--run_name=..", ("not . or ..",)),
])
def test_nonsense_values_stop_with_one_line_before_any_data_or_model(tmp_path, capsys, monkeypatch, flag, facts):
    def too_late(*args, **kwargs):
        raise AssertionError("the flag was checked only after data or a model was set up")
    monkeypatch.setattr(loaders, "make_loaders", too_late)
    monkeypatch.setattr(start, "starting_model", too_late)  # where train.py builds the model
    msg = fails(capsys, flag, f"--out_dir={tmp_path}", code=2)
    assert flag.split(",")[0] in msg and all(f in msg for f in facts), msg  # the flag, what it must be
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("value,expected", [("True", "true"), ("yes", "true"), ("1", "true"), ("ON", "true"),
                                            ("False", "false"), ("no", "false"), ("auto", "auto")])
def test_compile_parses_like_every_boolean_flag(value, expected):
    assert config.parse_args([f"--compile={value}"]) == {"compile": expected}
    if expected != "auto":
        assert config.parse_args([f"--zclip={value}"]) == {"zclip": expected == "true"}


def test_resume_without_checkpoint_fails_clearly(tmp_path, capsys):
    msg = fails(capsys, "--stage=1", "--resume=True", f"--out_dir={tmp_path}", *TINY)
    assert str(tmp_path / "stage1" / "ckpt.pt") in msg and "--resume" in msg


@pytest.mark.slow
def test_stage1_lowers_val_loss_then_stage2_starts_from_it(tmp_path):
    out = str(tmp_path)
    run("--stage=1", "--max_iters=60", "--eval_interval=30", "--lr=1e-2", f"--out_dir={out}", *BIGGER)
    recs = records(out, stage=1)
    first_loss = recs[0]["loss"]  # the untrained model on its first batch, about ln(257) = 5.55
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert abs(first_loss - math.log(257)) < 0.5
    assert vals[-1] < first_loss - 1.5 and vals[-1] < vals[0]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 60 and all(k in steps[0] for k in ("lr", "lambda", "raw_norm", "clipped_norm", "was_clipped", "z_score", "ms", "tok_per_s"))

    ckpt = torch.load(os.path.join(out, "stage1", "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 60 and not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert set(ckpt) >= {"model", "optimizer", "step", "config", "loader"}

    p = run("--stage=2", "--max_iters=20", "--eval_interval=20", f"--out_dir={out}", *BIGGER)
    assert "starting from the stage-1 weights" in p.stdout and "compile off" in p.stdout
    recs2 = records(out, stage=2)
    # lambda = 0 at step 0: the ternary model is exactly the stage-1 model, far below a fresh model's loss
    assert recs2[0]["lambda"] == 0.0 and recs2[0]["loss"] < first_loss - 1.0
    assert recs2[-1]["lambda"] == 1.0 and "WARNING" not in p.stdout  # lambda reached 1: no unfinished-warm-up line

    # stage 3: the stage-2 student distilled from the frozen stage-1 teacher; every term is logged
    p = run("--stage=3", "--max_iters=6", "--eval_interval=6", "--distill_relation_heads=2", f"--out_dir={out}",
            "--distill_preset=summarization", *BIGGER)
    assert "starting from the stage-2 weights" in p.stdout
    recs3 = [r for r in records(out, stage=3) if "loss" in r]
    assert len(recs3) == 6 and all(r["lambda"] == 1.0 for r in recs3)
    for r in recs3:  # summarization preset: lambda 1, gamma 1e3
        assert r["kd_logits"] > 0 and r["kd_relation"] > 0 and r["kd_hidden"] == 0
        assert r["loss"] == pytest.approx(r["ce"] + 1.0 * r["kd_logits"] + 1e3 * r["kd_relation"], rel=1e-5)
    # the control: same stage-3 run with every distillation weight 0 is plain CE
    p = run("--stage=3", "--max_iters=2", "--eval_interval=2", "--kd_logits=0", "--kd_relation=0",
            "--run_name=control", f"--out_dir={out}", *BIGGER)
    assert "plain CE" in p.stdout and os.path.exists(os.path.join(out, "control", "ckpt.pt"))


@pytest.mark.slow
def test_a_run_ending_before_lambda_reaches_1_says_so_and_stage3_names_the_remedy(tmp_path):
    out = str(tmp_path)
    run("--stage=1", "--max_iters=2", "--eval_interval=2", f"--out_dir={out}", *TINY)
    p = run("--stage=2", "--max_iters=3", "--eval_interval=3", f"--out_dir={out}", *TINY)  # warm-up is 4 steps
    final = [line for line in p.stdout.splitlines() if line.startswith("final val loss")]
    assert len(final) == 1 and "lambda only reached 0.75" in final[0] and "--max_iters=4" in final[0], p.stdout
    p = run("--stage=3", "--max_iters=1", "--eval_interval=1", f"--out_dir={out}", *TINY)
    assert "lambda 0.75" in p.stdout and "--stage=2 --resume=True" in p.stdout, p.stdout


def test_stage3_without_teacher_names_it_and_the_command(tmp_path, capsys):
    msg = fails(capsys, "--stage=3", f"--out_dir={tmp_path}", *TINY)
    assert "stage1/ckpt.pt" in msg and "python train.py --stage=1" in msg
    assert not os.path.exists(tmp_path / "stage3")  # refused before anything was written


@pytest.mark.slow
def test_stage1_inserts_subln_into_a_checkpoint_without_it(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    run("--stage=1", "--subln=False", "--max_iters=3", "--eval_interval=3", f"--out_dir={src}", *TINY)
    init = os.path.join(src, "stage1", "ckpt.pt")
    p = run("--stage=1", f"--init_from={init}", "--max_iters=0", f"--out_dir={dst}", *TINY)
    assert "SubLN inserted" in p.stdout
    before = torch.load(init, weights_only=True)["model"]
    after = torch.load(os.path.join(dst, "stage1", "ckpt.pt"), weights_only=True)["model"]
    sub = [k for k in after if ".subln." in k]
    assert len(sub) == 2 and all(torch.equal(after[k], torch.ones_like(after[k])) for k in sub)  # unit gain
    assert all(torch.equal(after[k], v) for k, v in before.items())  # everything else carried over


@pytest.mark.slow
def test_resume_continues_from_the_saved_step(tmp_path):
    out = str(tmp_path)
    run("--stage=1", "--max_iters=10", "--eval_interval=10", f"--out_dir={out}", *TINY)
    p = run("--stage=1", "--resume=True", "--max_iters=14", f"--out_dir={out}")
    assert "at step 10" in p.stdout
    recs = [r for r in records(out, stage=1) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 15))
    assert torch.load(os.path.join(out, "stage1", "ckpt.pt"), weights_only=True)["step"] == 14


def test_a_resume_cuts_a_torn_last_line_off_the_metrics_log(tmp_path):
    """A run killed while writing a record leaves a torn last line in metrics.jsonl: the resumed run cuts it off,
    says so, and appends its records as lines of their own (it once glued its first record onto the torn line, and
    tools.plot then refused the log)."""
    out = str(tmp_path)
    run("--stage=1", "--max_iters=4", "--eval_interval=4", f"--out_dir={out}", *TINY)
    path = os.path.join(out, "stage1", "metrics.jsonl")
    whole = open(path).read()
    with open(path, "a") as f:
        f.write('{"step": 5, "loss": 5.1')
    p = run("--stage=1", "--resume=True", "--max_iters=6", f"--out_dir={out}")
    assert f"cut the torn last line (a killed run's) off {path}" in p.stdout
    text = open(path).read()
    assert text.startswith(whole) and [r["step"] for r in records(out, stage=1) if "loss" in r][-2:] == [5, 6]
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedule_shapes(schedule):
    cfg = config.TrainConfig(schedule=schedule, max_iters=1000, warmup_steps=100, min_lr_frac=0.1, decay_frac=0.2)
    m = [train.lr_mult(s, cfg) for s in range(1001)]
    assert m[0] == pytest.approx(1 / 101) and m[99] == pytest.approx(100 / 101)  # linear warmup
    assert m[100] == pytest.approx(1.0) and m[1000] == pytest.approx(0.1)
    if schedule == "wsd":
        assert all(x == 1.0 for x in m[100:800]) and m[900] == pytest.approx(0.55)  # stable, then linear decay
    else:
        assert m[550] == pytest.approx(0.55) and all(a >= b for a, b in zip(m[100:], m[101:]))


def test_wsd_decays_over_exactly_its_fraction_of_the_steps():
    """The decay starts at floor(max_iters * (1 - decay_frac)) of the decimals given: 90 * (1 - 0.3) is
    62.99999999999999 in floats, which started the decay a step early (28 steps, not 27) at 2,336 lengths below
    100k for 0.3 alone. Checked against exact decimal arithmetic."""
    import math
    from fractions import Fraction
    for frac in (0.1, 0.2, 0.3, 0.8, 0.9):
        for n in (10, 90, 91, 100, 170, 330, 1000):
            cfg = config.TrainConfig(schedule="wsd", max_iters=n, warmup_steps=0, decay_frac=frac)
            start = math.floor(n * (1 - Fraction(str(frac))))
            # the decay's first step (progress 0) is at start
            assert train.lr_mult(start, cfg) == 1.0 and train.lr_mult(start + 1, cfg) < 1.0, (frac, n)


def test_lambda_warmup_is_linear_then_one():
    cfg = config.TrainConfig(stage=2, lambda_warmup_steps=200)
    assert [train.lambda_at(s, cfg) for s in (0, 50, 200, 999)] == [0.0, 0.25, 1.0, 1.0]


@pytest.mark.parametrize("every", [1, 10])
def test_logged_ms_per_step_does_not_depend_on_log_interval(tmp_path, monkeypatch, every):
    """ms and tok/s are per step, averaged over the steps since the last log line. A fake clock makes every
    step take exactly 0.25 s (and evaluation and checkpoints none), so each line must say 250 ms whatever
    --log_interval is (not one step's time divided by log_interval)."""
    from tools import runtime
    clock = [1000.0]
    monkeypatch.setattr(runtime, "time", type("FakeTime", (), {"time": staticmethod(lambda: clock[0])}))
    real_step = train.train_step

    def step_taking_a_quarter_second(*args, **kwargs):
        out = real_step(*args, **kwargs)
        clock[0] += 0.25
        return out
    monkeypatch.setattr(train, "train_step", step_taking_a_quarter_second)
    train.main(["--stage=2", *TINY, "--max_iters=20", "--eval_interval=15", f"--log_interval={every}",
                f"--out_dir={tmp_path}"])
    recs = [r for r in records(str(tmp_path)) if "ms" in r]
    assert [r["step"] for r in recs] == list(range(every, 21, every))
    assert all(r["ms"] == pytest.approx(250.0) for r in recs), [r["ms"] for r in recs]
    assert all(r["tok_per_s"] == pytest.approx(4 * 32 / 0.25) for r in recs)


def _spiked_run(clip, spike_step, seed=0, steps=50):
    """Train a tiny ternary model (initialised from seed) with train.py's optimizer and clipping; multiply the
    gradients by 100 at spike_step (None = no spike). Returns (loss on fixed val batches at the end, stats of
    the spike step, whether every step the clipper did not clip left the gradients bit for bit as backward()
    made them)."""
    import data
    from model import GPT
    cfg = config.TrainConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, warmup_steps=5,
                            max_iters=steps, zclip=clip == "zclip", grad_clip=0.0, device="cpu")
    src = loaders.resolve_data(cfg)
    loader = data.DataLoader(src, "train", 8, 32, order="sequential")
    val = data.DataLoader(src, "val", 8, 32, order="sequential")
    val_batches = [val.next_batch() for _ in range(8)]
    torch.manual_seed(seed)
    model = GPT(config.model_config(cfg, 257, 256))
    opt = train.configure_optimizer(model, cfg, "cpu")
    clipper = ZClip() if cfg.zclip else None
    spike_stats, untouched = None, True
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * train.lr_mult(step, cfg)
        x, y = loader.next_batch()
        model(x, y)[1].backward()
        if step == spike_step:
            for p in model.parameters():
                p.grad.mul_(100)
        params = [p for p in model.parameters() if p.grad is not None]
        before = [p.grad.clone() for p in params]
        stats = train.clip_gradients(params, clipper, cfg.grad_clip)
        if not stats.get("was_clipped", 0.0):
            untouched &= all(torch.equal(b, p.grad) for b, p in zip(before, params))
        if step == spike_step:
            spike_stats = {k: float(v) for k, v in stats.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches), spike_stats, untouched


@pytest.mark.slow
def test_zclip_rescues_a_run_from_a_gradient_spike():
    """A x100 spike at step 39 (after ZClip's 25-step warmup), the val loss read 11 steps later, as the
    mean of 3 seeds: one 50-step run of a tiny model moves by a percent with the last bits of its
    arithmetic (seed 0 alone: +0.9 % without clipping, seeds 1 and 2: +3.0 and +2.4 %)."""
    spike, seeds = 39, (0, 1, 2)
    clean, rescued, spiked_noclip = [], [], []
    for seed in seeds:
        loss, _, untouched = _spiked_run("zclip", None, seed)
        # ZClip never fired on the clean run and left every gradient bit for bit as it was, so the clean run is
        # the unclipped run. Checked within the run, not by comparing with a second run: two runs of the same
        # float program may differ in the last bits on some CPUs (MKL documents run-to-run differences from
        # memory alignment and from the threads it picks), which says nothing about clipping.
        assert untouched
        clean.append(loss)
        loss, st, _ = _spiked_run("zclip", spike, seed)
        assert st["was_clipped"] == 1.0 and st["z_score"] > 2.5 and st["clipped_norm"] < st["raw_norm"] / 10
        rescued.append(loss)
        loss, st, plain = _spiked_run("none", spike, seed)
        assert st["clipped_norm"] == st["raw_norm"] and plain  # clip_grad_norm_ at an infinite max touches nothing
        spiked_noclip.append(loss)
    clean, rescued, spiked_noclip = (torch.tensor(v, dtype=torch.float64) for v in (clean, rescued, spiked_noclip))
    with_zclip, without = (100 * (v - clean) / clean for v in (rescued, spiked_noclip))
    # README and lab/results/zclip.md quote these (pytest -n 0 -s)
    per_seed = ", ".join(f"{v:+.2f}" for v in without.tolist())
    print(f"\nval loss 11 steps after a x100 spike, against the clean run, mean +- std of {len(seeds)} seeds: "
          f"ZClip {with_zclip.mean():+.3f} +- {with_zclip.std():.3f} %, no clipping {without.mean():+.3f} +- "
          f"{without.std():.3f} % (seeds: {per_seed} %)")
    assert abs(with_zclip.mean()) < 0.5 and (with_zclip.abs() < 5).all()  # and within 5 % in every seed
    # Muon and AdamW both normalise update sizes, so the damage is modest (a few percent), but it is there: in
    # every seed, over 1 % on average, and more than 10x what is left with ZClip
    assert (without > 0.5).all() and without.mean() > 1.0 and without.mean() > 10 * abs(with_zclip.mean())


@pytest.mark.slow
def test_stage3_two_identical_teachers_train_exactly_like_one(tmp_path):
    # the mixture of two copies of one distribution is that distribution: the same run, step for step
    out = str(tmp_path)
    run("--stage=1", "--max_iters=4", "--eval_interval=4", f"--out_dir={out}", *TINY)
    run("--stage=2", "--max_iters=4", "--eval_interval=4", f"--out_dir={out}", *TINY)
    t = os.path.join(out, "stage1", "ckpt.pt")
    s3 = ("--stage=3", "--max_iters=3", "--eval_interval=3", "--kd_relation=0", f"--out_dir={out}", *TINY)
    run(*s3, f"--teacher={t}", "--run_name=one")
    p = run(*s3, f"--teacher={t},{t}", "--teacher_weights=2,2", "--run_name=two")
    assert "teachers" in p.stdout and "teacher_weights=[2.0, 2.0]" in p.stdout
    one, two = ([r for r in records(out, run_name=n) if "loss" in r] for n in ("one", "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert b["kd_logits"] > 0 and b["kd_logits"] == pytest.approx(a["kd_logits"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_stage3_teacher_sees_each_document_alone_as_the_student_and_is_cast_before_it_moves(tmp_path, monkeypatch):
    """--doc_mask=True: the student attends within documents only, and so must the teacher whose predictions it
    matches (an imported config, or a stage-1 run without the flag, has doc_mask off: its targets would use context
    the student cannot see). The teacher takes the student's doc_mask and eot: on a row of two documents its logits
    at the second equal its logits on that document alone. On CUDA it is cast to bf16 before it moves there (the
    GPU never holds the fp32 copy): the moves are recorded with the device taken out."""
    from model import GPTConfig
    out = str(tmp_path)
    run("--stage=1", "--max_iters=2", "--eval_interval=2", f"--out_dir={out}", *TINY)
    path = os.path.join(out, "stage1", "ckpt.pt")
    cfg = checks.build_config({"stage": 3, "device": "cpu", "kd_relation": 0, "block_size": 32})
    student = GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=32, doc_mask=True, eot=256)
    (teacher,), _ = start.make_teachers(cfg, [path], student, "cpu")
    assert (teacher.config.doc_mask, teacher.config.eot) == (True, 256)
    second = torch.tensor([[256, 5, 6, 7]])
    row = torch.cat([torch.tensor([[256, 1, 2]]), second], dim=1)
    with torch.no_grad():
        assert torch.allclose(teacher(row)[0][0, 3:], teacher(second)[0][0], atol=1e-5)
    moves = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda m, *a, **k: moves.append(a) or real_to(
        m, *[x for x in a if not isinstance(x, str)], **k))

    class Table:  # the fp32 RoPE tables, moved on their own: kept on the CPU (no CUDA here)
        def __init__(self, t):
            self.t = t

        def to(self, device):
            return self.t
    rope = start.precompute_rope
    monkeypatch.setattr(start, "precompute_rope", lambda *a: tuple(Table(t) for t in rope(*a)))
    start._frozen(teacher, student, "cuda:0")
    assert moves[:2] == [(torch.bfloat16,), ("cuda:0",)], moves


@pytest.mark.slow
def test_stage3_teacher_of_another_width_and_depth(tmp_path):
    # relations are re-split into relation heads and hidden states compared as token similarities, so a
    # 2-layer, 64-wide teacher teaches a 1-layer, 32-wide student
    out = str(tmp_path)
    wide = [a for a in TINY if not a.startswith(("--n_layer", "--n_embd"))] + ["--n_layer=2", "--n_embd=64"]
    run("--stage=1", "--max_iters=3", "--eval_interval=3", f"--out_dir={out}", "--run_name=wide", *wide)
    run("--stage=2", "--max_iters=3", "--eval_interval=3", "--init_from=scratch", f"--out_dir={out}", *TINY)
    run("--stage=3", "--max_iters=2", "--eval_interval=2", "--kd_relation=10", "--kd_hidden=1",
        "--distill_relation_heads=2", f"--teacher={os.path.join(out, 'wide', 'ckpt.pt')}", f"--out_dir={out}", *TINY)
    recs = [r for r in records(out, stage=3) if "loss" in r]
    assert all(r["kd_logits"] > 0 and r["kd_relation"] > 0 and r["kd_hidden"] > 0 for r in recs)
    r = recs[-1]
    assert r["loss"] == pytest.approx(r["ce"] + r["kd_logits"] + 10 * r["kd_relation"] + r["kd_hidden"], rel=1e-5)
    # over 2 micro-batches each logged term is their mean, as the loss (it was the last micro-batch's)
    run("--stage=3", "--max_iters=2", "--eval_interval=2", "--kd_relation=10", "--kd_hidden=1", "--grad_accum=2",
        "--distill_relation_heads=2", f"--teacher={os.path.join(out, 'wide', 'ckpt.pt')}", f"--out_dir={out}",
        "--run_name=accum", *TINY)
    for r in [r for r in records(out, run_name="accum") if "loss" in r]:
        assert r["loss"] == pytest.approx(r["ce"] + r["kd_logits"] + 10 * r["kd_relation"] + r["kd_hidden"],
                                          rel=1e-5), r


def test_quant_start_trains_in_full_precision_then_ramps_lambda_from_the_switch():
    """Continual QAT: lambda is 0 before --quant_start (a fraction of max_iters or a step), then ramps over
    lambda_warmup_steps from there, not from step 0."""
    cfg = config.TrainConfig(stage=2, max_iters=1000, lambda_warmup_steps=100, quant_start=0.5)
    lam = [train.lambda_at(s, cfg) for s in (0, 499, 500, 550, 600, 999)]
    assert lam == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0]
    assert train.lambda_at(250, dataclasses.replace(cfg, quant_start=200)) == 0.5  # >= 1: a step
    assert train.lambda_at(50, dataclasses.replace(cfg, quant_start=0)) == 0.5    # 0: ternary QAT from the start


@pytest.mark.slow
def test_quant_start_run_is_the_fp_run_until_the_switch(tmp_path):
    """Before the switch a stage-2 run computes what stage 1 (full precision, same seed and schedule)
    computes, step for step; from the switch on it departs, and lambda ramps 0 -> 1 as logged."""
    out = str(tmp_path)
    common = [*TINY, "--max_iters=12", "--eval_interval=12", "--schedule=wsd", "--init_from=scratch", f"--out_dir={out}",
              "--lr=3e-3", "--muon_lr=3e-3"]  # one lr for both (the CPU stage-2 preset's is 2e-2)
    run("--stage=1", *common)
    run("--stage=2", "--quant_start=6", *common)
    fp = [r for r in records(out, stage=1) if "loss" in r]
    q = [r for r in records(out, stage=2) if "loss" in r]
    assert [r["lambda"] for r in q] == [0.0] * 6 + [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]  # the lambda of step r["step"]-1
    assert [r["loss"] for r in q[:7]] == pytest.approx([r["loss"] for r in fp[:7]], rel=1e-6, abs=0)
    assert abs(q[9]["loss"] - fp[9]["loss"]) > 1e-4


@pytest.mark.parametrize("flag", ["--quant_start=-1", "--quant_start=1.5", "--quant_start=nan"])
def test_bad_quant_start_is_refused(capsys, flag):
    assert flag in fails(capsys, "--stage=2", flag, code=2)


def test_quant_start_outside_stage_2_is_refused(capsys):
    assert "stage 1" in fails(capsys, "--stage=1", "--quant_start=0.5", code=2)


@pytest.mark.parametrize("argv, needs", [
    (["--stage=2", "--kd_logits=1"], "stage 3"), (["--stage=1", "--teacher=t.pt"], "stage 3"),
    (["--stage=2", "--kd_hidden=10"], "stage 3"), (["--zclip=False", "--zclip_z_thresh=3"], "ZClip"),
    (["--grad_clip=0.5"], "--zclip=False"),
    (["--two_phase_lr_drop=0.3"], "two-phase"), (["--avg_alpha=0.5"], "averaging"),
    (["--stage=2", "--dlm_mask_init=random"], "--stage=dlm")])
def test_a_flag_for_something_the_run_does_not_do_is_refused_not_ignored(capsys, argv, needs):
    """--kd_logits in stage 2 trained without distillation and said nothing: a flag that acts only under another
    stage or switch is one line naming it and what it needs; under that switch it is taken."""
    line = fails(capsys, *argv, code=2)
    assert argv[-1] in line and needs in line, line
    assert checks.build_config({"stage": 3, "kd_logits": 2.0, "device": "cpu"}).kd_logits == 2.0
    assert checks.build_config({"zclip_z_thresh": 3.0, "device": "cpu"}).zclip_z_thresh == 3.0
    assert checks.build_config({"zclip": False, "grad_clip": 0.5, "device": "cpu"}).grad_clip == 0.5


def test_constant_and_moderate_schedules():
    """constant: warmup then the peak to the end; moderate: WSD ending at 1/3 of the peak (Luo et al.'s preset),
    its end movable with --min_lr_frac like any WSD."""
    cfg = checks.build_config({"schedule": "constant", "max_iters": 100, "warmup_steps": 10, "device": "cpu"})
    assert [train.lr_mult(s, cfg) for s in (0, 10, 99, 100)] == [pytest.approx(1 / 11), 1.0, 1.0, 1.0]
    cfg = checks.build_config({"schedule": "moderate", "max_iters": 100, "warmup_steps": 10, "device": "cpu"})
    assert cfg.min_lr_frac == pytest.approx(1 / 3) and train.lr_mult(100, cfg) == pytest.approx(1 / 3)
    assert train.lr_mult(79, cfg) == 1.0 and train.lr_mult(90, cfg) == pytest.approx(1 - (2 / 3) / 2)
    cfg = checks.build_config({"schedule": "moderate", "min_lr_frac": 0.5, "max_iters": 100, "device": "cpu"})
    assert train.lr_mult(100, cfg) == pytest.approx(0.5)
    assert seams.avg_interval(dataclasses.replace(cfg, avg_checkpoints=6, max_iters=600)) == 20  # 0.2 * 600 / 6


@pytest.mark.slow
def test_final_val_loss_is_over_the_whole_val_split_per_source_and_weighted(tmp_path):
    """Two corpora mixed 3:1: every evaluation logs each source's val loss and their 3:1 total; the final one
    reads every val window once and equals lab/runner.py's independent whole-split scoring of the checkpoint.
    (Two slices of the shipped Shakespeare shards, conftest.small_corpus: a whole val split of 62 windows each.)"""
    from lab import runner
    out = str(tmp_path / "o")
    a = small_corpus(tmp_path / "plays_a")
    b = small_corpus(tmp_path / "plays_b", start=40000)
    p = run(f"--out_dir={out}", "--stage=2", "--init_from=scratch", *TINY, "--eval_whole=True", "--max_iters=4",
            "--eval_interval=2", f"--data={a}:0.75,{b}:0.25")
    evals = [r for r in records(out) if "val_loss" in r]
    assert [r["whole_val"] for r in evals] == [False, True]
    for r in evals:
        by = r["val_loss_by_source"]
        assert set(by) == {"plays_a", "plays_b"}
        assert by["plays_a"] != by["plays_b"]  # two val splits, not one read twice
        assert r["val_loss"] == pytest.approx(0.75 * by["plays_a"] + 0.25 * by["plays_b"], rel=1e-12)
    ckpt = os.path.join(out, "stage2", "ckpt.pt")
    for name, by in evals[-1]["val_loss_by_source"].items():
        want, _ = runner.full_val_loss(ckpt, str(tmp_path / name))
        assert by == pytest.approx(want, abs=1e-5), name
    assert "plays_b" in p.stdout and "over the whole val split" in p.stdout


# ----------------------------------------------------------------------------- in-process runs (train.setup)


@pytest.fixture
def setup_run(tmp_path):
    """setup_run(*flags): train.setup of a TINY stage-2 run (flags on top; out_dir under tmp_path) in this process,
    the Run that train_step and estimate_val_loss take; its out_dir lock is released at teardown."""
    made = []

    def make(*flags):
        out = tmp_path / f"run{len(made)}"
        made.append(train.setup(["--stage=2", "--init_from=scratch", *TINY, "--max_iters=10", f"--out_dir={out}",
                                 *flags]))
        return made[-1]
    yield make
    for r in made:
        r.unlock()


def test_two_phase_drops_lr_and_weight_decay_from_step_max_iters_over_2_on(setup_run):
    """--two_phase=True (BitNet b1.58's recipe): the second half, steps max_iters // 2 = 5 .. 9 inclusive, trains
    at lr x two_phase_lr_drop with weight decay 0; steps 0 .. 4 at the peak lr (constant schedule, no warmup) and
    the configured decay."""
    run = setup_run("--two_phase=True", "--two_phase_lr_drop=0.5", "--schedule=constant", "--warmup_steps=0")
    assert any(g["initial_wd"] > 0 for g in run.optimizer.param_groups)
    for step, mult, decay in ((0, 1.0, True), (4, 1.0, True), (5, 0.5, False), (9, 0.5, False)):
        assert train.lr_mult(step, run.cfg) == mult, step
        out = train.train_step(run, step, False)
        assert out["lr"] == run.cfg.lr * mult, step
        for g in run.optimizer.param_groups:
            assert g["lr"] == g["initial_lr"] * mult and g["weight_decay"] == (g["initial_wd"] if decay else 0.0), step


def test_quant_start_1_is_step_1_not_a_fraction_of_the_run():
    """--quant_start below 1 is a fraction of max_iters, from 1 on a step: 1 means step 1 (not max_iters), so
    lambda is 0 at steps 0 and 1 and then ramps over lambda_warmup_steps."""
    cfg = checks.build_config({"stage": 2, "max_iters": 1000, "lambda_warmup_steps": 100, "quant_start": 1.0,
                               "device": "cpu"})
    assert train.quant_start_step(cfg) == 1
    assert [train.lambda_at(s, cfg) for s in (0, 1, 51, 101, 999)] == [0.0, 0.0, 0.5, 1.0, 1.0]


def test_evaluations_of_the_same_weights_read_the_same_val_rows_and_agree(setup_run):
    """Every evaluation starts each val loader from its first window: two evaluations of the same weights give the
    same number, the mean token loss over the first eval_iters batches of a fresh sequential val loader."""
    run = setup_run("--eval_iters=2")
    for step in range(2):
        train.train_step(run, step, False)
    first, second = metrics.estimate_val_loss(run), metrics.estimate_val_loss(run)
    assert first == second
    import data
    (name, (loader, _)), = run.val_loaders.items()
    fresh = data.DataLoader(loader.dirs[0], "val", run.cfg.batch_size, run.cfg.block_size, order="sequential")
    run.model.eval()
    with torch.no_grad():
        want = sum(run.model(*fresh.next_batch())[1].item() for _ in range(2)) / 2
    run.model.train()
    assert first[1][name] == pytest.approx(want, rel=1e-6)


def test_teacher_weights_apply_to_the_teachers_in_the_order_given(setup_run, tmp_path):
    """--teacher=a,b --teacher_weights=1,0 distils from a alone and 0,1 from b alone: stage 3's logged kd_logits
    equals logits_kd_loss (distill.py) of the student's logits against that teacher's logits, computed here."""
    from distill import logits_kd_loss
    from model import GPT, GPTConfig
    conf = GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32, quant=False)
    teachers, paths = [], []
    for seed in (1, 2):  # two different full-precision teachers, saved as train.py saves a checkpoint's weights
        torch.manual_seed(seed)
        teachers.append(GPT(conf).eval())
        paths.append(str(tmp_path / f"teacher{seed}.pt"))
        torch.save({"model": teachers[-1].state_dict(), "model_args": dataclasses.asdict(conf)}, paths[-1])
    for weights, which in (("1,0", 0), ("0,1", 1)):
        run = setup_run("--stage=3", f"--teacher={','.join(paths)}", f"--teacher_weights={weights}",
                        "--kd_relation=0")
        x, y = run.train_loader.next_batch()
        _, parts = run.loss_fn(x, y)
        with torch.no_grad():
            s_logits = run.model(x, y)[0]
            want = [logits_kd_loss(s_logits, t(x, y)[0], run.cfg.distill_tau, mask=y != -1).item() for t in teachers]
        assert parts["kd_logits"].item() == pytest.approx(want[which], rel=1e-5), (weights, want)
        assert want[which] != pytest.approx(want[1 - which], rel=1e-3)  # the teachers do differ


def test_metrics_jsonl_names_the_commit_of_the_code_that_wrote_each_run_and_each_resume(tmp_path):
    """The first record a train.py process writes into metrics.jsonl names the commit of the code (git rev-parse HEAD
    of this checkout, -dirty after it when a tracked file differs, or "unknown" outside a git checkout); a resumed run's first record names its own."""
    import subprocess
    from tools import runtime
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    want = p.stdout.strip() + ("-dirty" if changed else "") if p.returncode == 0 else "unknown"
    flags = ["--stage=2", *TINY, "--eval_interval=2", f"--out_dir={tmp_path}"]
    train.main([*flags, "--max_iters=2"])
    train.main([*flags, "--max_iters=3", "--resume=True"])
    recs = records(str(tmp_path))
    assert [r.get("val_loss") is None for r in recs] == [True, True, False, True, False]  # steps 1, 2 | 3
    assert [i for i, r in enumerate(recs) if "commit" in r] == [0, 3] and recs[0]["commit"] == recs[3]["commit"] == want
    assert runtime.git_commit(str(tmp_path)) == "unknown"  # no checkout there


# ----------------------------------------------------------------------------- the CPU stage-2 preset
# and the gradient scale of accumulation, pinned directly


def test_the_cpu_stage2_preset_is_what_the_lr_and_warmup_tables_chose_and_what_a_run_uses():
    """DEVICE_STAGE_PRESETS[("cpu", 2)] holds measured values: the peak lr the lr table chose (lab/results/lr.md:
    2e-2, the lowest mean val loss of 3 seeds over 2e-3 .. 4e-2) and the lambda warm-up the warmup table chose at
    that lr (lab/results/warmup.md: 600 steps, over 0 .. 600). Both are read here from the tables' data (lr.json,
    warmup.json: the best row's mean and the flags its runs were given), so a preset edited by hand, or a table
    re-measured without the preset following, fails. A CPU stage-2 run resolves to them, and lambda reaches 1 at
    the quick start's last step."""
    import json

    def best(table, flag):
        with open(os.path.join(ROOT, "lab", "results", f"{table}.json")) as f:
            t = json.load(f)
        row = min(t["summary"], key=lambda r: t["summary"][r]["mean"])
        given = {a.split("=", 1)[1] for r in t["runs"] if r["row"] == row for a in r["argv"] if a.startswith(f"--{flag}=")}
        assert len(given) == 1 and len(t["seeds"]) == 3, (table, row, given)
        return given.pop(), t
    lr, _ = best("lr", "lr")
    warmup, warmup_table = best("warmup", "lambda_warmup_steps")
    lr, warmup = float(lr), int(warmup)
    assert (lr, warmup) == (2e-2, 600)  # what lr.md and warmup.md say today
    lrs = [float(a.split("=")[1]) for r in warmup_table["runs"] for a in r["argv"] if a.startswith("--lr=")]
    assert lrs and set(lrs) == {lr}  # the warm-up was measured at the lr the lr table chose
    assert config.DEVICE_STAGE_PRESETS[("cpu", 2)] == dict(lr=lr, muon_lr=lr, lambda_warmup_steps=warmup)
    cfg = checks.build_config(config.parse_args(["--stage=2", "--device=cpu"]))
    assert (cfg.lr, cfg.muon_lr, cfg.lambda_warmup_steps, cfg.max_iters) == (lr, lr, warmup, 600)
    assert [train.lambda_at(s, cfg) for s in (0, 300, 599, 600)] == [0.0, 0.5, 599 / 600, 1.0]
    assert checks.build_config({"stage": 2, "device": "cpu", "lambda_warmup_steps": 200}).lambda_warmup_steps == 200
    assert checks.build_config({"stage": 1, "device": "cpu"}).lambda_warmup_steps == config.TrainConfig.lambda_warmup_steps


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accum_averages_the_micro_batches_gradients(setup_run, monkeypatch, k):
    """One step over k micro-batches of B sequences leaves the same gradients (read just before the optimizer
    step) as one step over their concatenation, k*B sequences in one micro-batch: each micro-batch's loss is divided
    by k before backward. Summing instead would make every gradient k times larger, and neither the update (Muon
    and AdamW are nearly blind to the gradient's scale) nor one step's loss would show it. Stage 2 at lambda 0.5
    (step 2 of a 4-step warm-up), so the k micro-batches also share the step's cached ternary weights."""
    import types
    B = 2
    run = setup_run(f"--grad_accum={k}", f"--batch_size={B}", "--zclip=False", "--grad_clip=0")
    T, V = run.cfg.block_size, run.model.config.vocab_size
    gen = torch.Generator().manual_seed(k)
    x, y = torch.randint(0, V, (k * B, T), generator=gen), torch.randint(0, V, (k * B, T), generator=gen)
    grads = []
    monkeypatch.setattr(run.optimizer, "step", lambda *a, **kw: grads.append(
        {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}))
    outs = []
    for accum, batches in ((k, list(zip(x.split(B), y.split(B)))), (1, [(x, y)])):
        run.accum, feed = accum, iter(batches)
        run.train_loader = types.SimpleNamespace(next_batch=feed.__next__)
        outs.append(train.train_step(run, 2, False))
        assert next(feed, None) is None  # every micro-batch was read
    (accumulated, whole), (out_k, out_1) = grads, outs
    assert out_k["lam"] == 0.5 and out_k["ok"] and set(accumulated) == set(whole) and len(whole) > 5
    ratio = out_k["raw_norm"] / out_1["raw_norm"]
    assert ratio == pytest.approx(1.0, rel=1e-5), f"grad_accum={k}: gradient norm x{ratio:.3f} (x{k}: summed)"
    for name, g in whole.items():
        torch.testing.assert_close(accumulated[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert out_k["loss"] == pytest.approx(out_1["loss"], rel=1e-6)


def test_a_checkpoint_named_in_a_models_tokenizer_keeps_the_pretrained_preset_and_stage_1_keeps_its_own():
    """Stage 2 or 3 from a checkpoint named explicitly, in a model's tokenizer (what check_fits asks of a checkpoint
    of a run that began from a pretrained model): AdamW at 1e-4 as with --init_from=auto. Stage 1 in a model's
    tokenizer, from scratch or from a checkpoint, keeps its own preset (Muon at 3e-3)."""
    from tools.checks import build_config
    model = "HuggingFaceTB/SmolLM2-135M"  # a hub id: a pretrained model by name (nothing is downloaded here)
    for stage in (2, 3):
        c = build_config({"stage": stage, "init_from": "out/stage1/ckpt.pt", "tokenizer": model, "device": "cpu",
                          **({"teacher": "t.pt"} if stage == 3 else {})})
        assert (c.optimizer, c.lr) == ("adamw", 1e-4), stage
    for flags in ({"stage": 1, "tokenizer": model}, {"stage": 1, "init_from": "out/stage1/ckpt.pt", "tokenizer": model}):
        c = build_config({**flags, "device": "cpu"})
        assert (c.optimizer, c.lr) == ("muon", 3e-3), flags


def test_a_pretrained_model_trains_with_adamw_at_1e_4_unless_told_otherwise():
    """tools/config.py's PRETRAINED_PRESET: --init_from or --teacher a pretrained model, or stage 2/3 after a stage that
    began from one (train.py passes its tokenizer), gets AdamW at 1e-4; a flag given wins; from scratch keeps the
    CPU stage-2 preset (lr 2e-2, Muon), even in a model's tokenizer."""
    from tools.checks import build_config
    model = "HuggingFaceTB/SmolLM2-135M"  # a hub id: a pretrained model by name (nothing is downloaded here)
    for flags in ({"stage": 2, "init_from": model}, {"stage": 3, "teacher": model}, {"stage": 2, "tokenizer": model},
                  {"tokenizer": model}):
        c = build_config({**flags, "device": "cpu"})
        assert (c.optimizer, c.lr) == ("adamw", 1e-4), flags
    c = build_config({"stage": 2, "init_from": model, "lr": 3e-4, "optimizer": "muon", "device": "cpu"})
    assert (c.optimizer, c.lr) == ("muon", 3e-4)
    for flags in ({"stage": 2}, {"stage": 2, "init_from": "scratch", "tokenizer": model}):
        c = build_config({**flags, "device": "cpu"})
        assert (c.optimizer, c.lr) == ("muon", 2e-2), flags


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--stage=2",), ("--stage=2", "--doc_mask=True", "--grad_accum=2"), ("--stage=1",)])
def test_the_compiled_training_step_has_no_graph_break_and_no_recompile_as_lambda_and_steps_move(setup_run,
                                                                                                    monkeypatch, flags):
    """--compile=true compiles what train_step calls (the model, train.setup's wrap) into ONE
    graph for training, whatever lambda (0, 0.25 ... 1 over TINY's 4 warm-up steps: a buffer, not a constant), the
    step, or the weight-quant cache of grad_accum; an evaluation runs the model uncompiled, so it adds no graph
    (a no_grad graph would be a second compile). After that, any recompile raises (error_on_recompile)."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend=counter, **kw))
    run = setup_run(*flags, "--compile=true")
    lams = [train.train_step(run, step, False)["lam"] for step in range(3)]
    assert counter.frame_count == 1
    metrics.estimate_val_loss(run)
    run.model.train()
    assert counter.frame_count == 1  # no graph for the evaluation
    with torch._dynamo.config.patch(error_on_recompile=True):
        lams += [train.train_step(run, step, False)["lam"] for step in range(3, 7)]
        metrics.estimate_val_loss(run)
        run.model.train()
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert lams == ([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0] if "--stage=2" in flags else [0.0] * 7)


@pytest.fixture
def cpu_flags_restored():
    """torch's process-wide settings that train.setup changes when it compiles on the CPU (deterministic mode, the
    NaN fill of new memory) and the thread count, as they were before the test."""
    import torch.utils.deterministic as det
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             det.fill_uninitialized_memory, torch.get_num_threads())
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    det.fill_uninitialized_memory, _ = saved[2], torch.set_num_threads(saved[3])
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_cpu_training_gives_the_same_bits_on_every_run(setup_run, cpu_flags_restored):
    """Inductor's CPU kernel for the embedding's gradient adds token rows into place with atomic adds from every
    thread, so without train.setup's deterministic mode (tools/runtime.deterministic_cpu_compile) the order of the
    adds, and the last bits of the gradient, changed from call to call. Here the model's compiled forward and
    backward on the quick start's 16 x 256 tokens, on 2 threads, 6 times: one set of gradient bits, and the
    step's loss as eager's to fp32 rounding."""
    import torch.utils.deterministic as det
    run = setup_run("--compile=true", "--block_size=256")
    assert torch.are_deterministic_algorithms_enabled() and not det.fill_uninitialized_memory
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, run.model.config.vocab_size, (16, 256), generator=g) for _ in range(2))
    grads = []
    for _ in range(6):
        run.model.zero_grad(set_to_none=True)
        _, loss = run.train_model(x, y)
        loss.backward()
        grads.append(run.model.wte.weight.grad.clone())
    assert all(torch.equal(grads[0], other) for other in grads[1:])
    run.model.zero_grad(set_to_none=True)
    _, eager_loss = run.model(x, y)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [("--zclip=True", "--grad_accum=2"), ("--zclip=False", "--grad_clip=1.0")])
def test_a_training_step_reads_the_device_once(setup_run, monkeypatch, flags):
    """train_step's one host read is read_step's: no .item(), float(t), bool(t) or `if t:` anywhere else in the
    forward, backward, weight-quant cache, ZClip or clip_grad_norm_ (each is a host sync on a GPU; they all
    dispatch to aten._local_scalar_dense). The optimizer step is left out: torch.optim keeps its step counters on
    the CPU (fused AdamW on CUDA keeps them on the GPU), so its reads of them wait for nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads, self.paused = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
                self.reads.append(func)
            return func(*args, **(kwargs or {}))

    run = setup_run(*flags)
    mode, read_step, opt_step = ScalarReads(), train.read_step, run.optimizer.step
    calls = []

    def unwatched(f, name):
        def g(*a, **kw):
            calls.append(name)
            mode.paused = True
            try:
                return f(*a, **kw)
            finally:
                mode.paused = False
        return g
    monkeypatch.setattr(train, "read_step", unwatched(read_step, "read_step"))
    monkeypatch.setattr(run.optimizer, "step", unwatched(opt_step, "opt.step"))
    for step in range(4):
        with mode:
            out = train.train_step(run, step, False)
        assert out["ok"] and math.isfinite(out["loss"])
    assert calls == ["read_step", "opt.step"] * 4
    assert mode.reads == [], len(mode.reads)
    with mode:
        float(run.model.wte.weight.detach().sum())  # the detector sees a host read
    assert len(mode.reads) == 1


def test_each_optimizer_group_follows_its_own_lr_muon_its_muon_lr(setup_run):
    """The schedule scales each group's own initial_lr: Muon's groups train at --muon_lr x mult, AdamW's at --lr x
    mult (one lr for every group would give Muon AdamW's lr; the other tests use muon_lr = lr and cannot tell)."""
    run = setup_run("--optimizer=muon", "--lr=1e-3", "--muon_lr=5e-2", "--warmup_steps=4")
    kinds = {g["kind"] for g in run.optimizer.param_groups}
    assert kinds == {"muon", "adamw"}
    for step in (1, 3):
        mult = train.lr_mult(step, run.cfg)
        train.train_step(run, step, False)
        for g in run.optimizer.param_groups:
            want = (5e-2 if g["kind"] == "muon" else 1e-3) * mult
            assert g["lr"] == pytest.approx(want, rel=1e-12), (step, g["kind"], g["lr"], want)


def test_float16_scales_the_loss_so_that_small_gradients_survive(setup_run):
    """--dtype=float16 (autocast, here on the CPU): fp16 flushes gradients under 6e-8 to zero, so the step scales the
    loss up and the gradients back down (train.LossScale). With the loss 2**-14 times smaller (a token's share of a
    65,536-token step, as the CUDA preset's), every gradient matches the fp32 step's within 1 %; with the scale
    taken out, the embedding's gradient came out all zero (a finite step that learns nothing). A step that overflows is
    skipped and halves the scale: the tiny model at its real loss backs off from 65,536 to a scale that fits within
    7 skipped steps, then trains. bf16 and fp32 steps are not scaled."""
    def small_grads(run):
        real, got = run.loss_fn, {}
        run.loss_fn = lambda x, y: (lambda loss, parts: (loss * 2.0**-14, parts))(*real(x, y))
        step = run.optimizer.step

        def record(*a, **k):
            got.update({n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})
            return step(*a, **k)
        run.optimizer.step = record
        return train.train_step(run, 0, False), got

    (out32, want), (out16, got) = small_grads(setup_run("--dtype=float32")), small_grads(setup_run("--dtype=float16"))
    assert "loss_scale" not in out32 and out16["ok"] and out16["loss_scale"] == 2.0**16
    assert set(got) == set(want)
    for n in want:
        assert (got[n] - want[n]).norm() <= 0.01 * want[n].norm(), n
    run = setup_run("--dtype=float16")
    scales = []
    for step in range(8):
        out = train.train_step(run, step, False)
        scales.append((out["loss_scale"], out["ok"]))
        if out["ok"]:
            break
    assert scales[0] == (2.0**16, False) and scales[-1][1] and len(scales) <= 8, scales
    assert [s for s, _ in scales] == [2.0**16 / 2**i for i in range(len(scales))]
    assert run.loss_scale.scale == scales[-1][0] and run.loss_scale.good == 1
    from tools import checkpoint
    checkpoint.save_run(run, len(scales))  # a resume scales as the run that never stopped
    run.unlock()
    resumed = train.setup(["--stage=2", *TINY, "--max_iters=10", f"--out_dir={os.path.dirname(run.out_dir)}",
                           "--resume=True", "--dtype=float16"])
    try:
        assert (resumed.loss_scale.scale, resumed.loss_scale.good) == (scales[-1][0], 1)
    finally:
        resumed.unlock()
    ls = train.LossScale(True, interval=3)
    for ok, want_scale in ((False, 2.0**15), (True, 2.0**15), (True, 2.0**15), (True, 2.0**16), (False, 2.0**15)):
        ls.update(ok)
        assert ls.scale == want_scale
    assert train.LossScale(False).scale == 1.0


def test_dtype_auto_is_bf16_on_a_gpu_with_bf16_units_float16_on_an_older_one_float32_on_a_cpu(monkeypatch):
    """--dtype=auto: on a T4 or V100 bf16 is emulated (slow) and inductor skips compiling it, so float16, whose
    loss is scaled (train.LossScale); bf16 from Ampere on; float32 on a CPU."""
    from tools import assemble
    for native, want in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or (
            including_emulation and pytest.fail("asked whether bf16 is emulated")))
        assert assemble.auto_dtype(True) == want
    assert assemble.auto_dtype(False) == "float32"


def test_a_float16_runs_loss_scale_backing_off_is_not_a_run_of_bad_steps(tmp_path, capsys, setup_run):
    """The tiny model's float16 gradients overflow at the first loss scales (65536, 32768, ...) while its loss is
    finite: the scale backs off, which GradScaler does for as many steps as it takes. Those skips are logged but not
    counted toward --max_bad_steps, so a run allowed 2 bad steps in a row gets past its back-offs and trains; a
    non-finite loss under float16 is no back-off and still counts."""
    train.main(["--stage=1", *TINY, "--dtype=float16", "--max_iters=10", "--max_bad_steps=2",
                f"--out_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    backoffs = re.findall(r"^step \d+ \| skipped: .*float16 loss scale (\d+) halved \(overflow at a finite loss",
                          out, re.M)
    assert len(backoffs) > 2 and [int(s) for s in backoffs[:3]] == [65536, 32768, 16384], out
    assert "final val loss" in out and "(stage1, 10 steps," in out, out
    run = setup_run("--dtype=float16")
    real = run.loss_fn
    run.loss_fn = lambda x, y: (lambda loss, parts: (loss * float("nan"), parts))(*real(x, y))
    out = train.train_step(run, 0, False)
    assert not out["ok"] and out["backoff"] is False and out["loss_scale"] == 2.0**16


def test_a_float16_run_too_short_for_its_loss_scale_says_why_nothing_was_learned(tmp_path, capsys):
    """The tiny model overflows at float16's first loss scales (65536, 32768, ...): a 3-step run skips them all,
    and its error line says the loss scale backs off, not only that the data or the lr may be bad."""
    msg = fails(capsys, "--stage=1", *TINY, "--dtype=float16", "--max_iters=3", f"--out_dir={tmp_path}")
    assert "all 3 steps of this run were skipped" in msg and "float16: the loss scale halves from 65536" in msg, msg


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_finite_loss_with_a_non_finite_gradient_skips_the_update(setup_run, bad):
    """The step's one read decides on the loss AND the gradient norm: a finite loss whose gradient is inf or NaN
    (here one parameter's gradient, through a hook) is not applied, and every weight stays as it was."""
    run = setup_run()
    p = next(p for n, p in run.model.named_parameters() if n.endswith("q_proj.weight"))
    hook = p.register_hook(lambda g: torch.full_like(g, bad))
    before = {n: q.detach().clone() for n, q in run.model.named_parameters()}
    out = train.train_step(run, 1, False)
    hook.remove()
    assert math.isfinite(out["loss"]) and not math.isfinite(out["raw_norm"])
    assert out["ok"] is False
    for n, q in run.model.named_parameters():
        assert torch.equal(q.detach(), before[n]), n


def test_the_step_read_averages_the_loss_and_its_parts_over_the_ranks(monkeypatch):
    """Under torchrun each rank sums its own micro-batches: read_step averages the loss and stage 3's parts (ce,
    kd_*) over the ranks in its one all-reduce, and ORs the stop flag; the other statistics (grad norms,
    already global) pass as they are. Here a stand-in all_reduce adds the other rank's values. (Before: the parts
    were rank 0's alone, so the logged ce and kd terms did not add up to the logged loss.)"""
    other = torch.tensor([3.0, 4.0, 10.0, 1.0])  # rank 1: loss, ce, kd_logits, its stop flag

    class TwoRanks:
        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_world_size():
            return 2

        @staticmethod
        def all_reduce(t):
            t.add_(other)
    monkeypatch.setattr(train, "dist", TwoRanks)
    out = train.read_step(torch.tensor(1.0), False, {"raw_norm": torch.tensor(7.0)},
                          {"ce": torch.tensor(2.0), "kd_logits": torch.tensor(6.0)})
    assert out == {"loss": 2.0, "ce": 3.0, "kd_logits": 8.0, "stop": True, "raw_norm": 7.0}
