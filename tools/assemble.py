"""
A training run assembled before its first step, in the order nothing saved can be lost: the flags
and a resumed run's saved config (read_config), every input checked and out_dir locked (open_run),
then the tokenizer, the data, the runtime and the starting model (starting_model); after train.py
has added what the recipe decides (the wrapped model, the loss, the optimizer, the clipper), an
earlier run in out_dir is removed only with --overwrite=True, and the run says what it is (finish).

    overrides, out_dir, resume, cfg, notes = read_config(argv)
    teachers = open_run(run, notes)                 # run: Run, what a run holds
    earlier, dtype = starting_model(run, resume)
    ...                                             # train.build: wrap, loss, optimizer, ZClip
    finish(run, earlier, use_compile, dtype)

Used by train.setup; tested through it (tests/test_train.py, test_fault.py, test_outputs.py).
"""

import dataclasses
import os
from dataclasses import dataclass

import torch

import data
from model import GPT
from tokenizer import get_tokenizer
from tools import checkpoint, loaders, seams, start
from tools.checks import build_config, check_resume, check_run, teacher_paths
from tools.config import TrainConfig, model_config, parse_args, stage_dir
from tools.flags import die
from tools.runtime import Runtime, git_commit
from zclip import ZClip


@dataclass
class Run:
    """Everything train_step and the loop touch, built once by setup()."""
    cfg: TrainConfig
    rt: Runtime
    out_dir: str
    given: dict = dataclasses.field(default_factory=dict)  # the flags given on the command line,
                                                           # {name: value}
    model: GPT = None            # the model itself: its weights are what checkpoints hold
    vocab: int = 0               # the tokenizer's ids (the model's rows past them: --pad_vocab's padding)
    train_model: object = None   # what the step calls: model, compiled and/or wrapped in DDP
    optimizer: object = None
    clipper: ZClip = None
    loss_fn: object = None
    train_loader: data.DataLoader = None
    val_loaders: dict = None     # source name -> (its val DataLoader, its mixing weight)
    autocast: object = None
    loss_scale: object = None    # train.LossScale: float16's dynamic loss scale (1 otherwise)
    accum: int = 1               # micro-batches per step on this rank
    device: str = "cpu"          # where the step runs (rt.device)
    start: "start.Start" = None  # where the run starts: its step, weights and note (tools/start.py)
    callbacks: list = dataclasses.field(default_factory=list)  # the lessons' step callbacks
                                                               # (tools/seams.py)
    average: object = None       # --avg_checkpoints: the average of the last checkpoints (one of
                                 # the callbacks)
    lesson: object = None        # a lesson's own stage (tools/seams.py: --stage=dlm), else None
    eval_loss: object = None     # a lesson's evaluation loss (eval_loss(run) -> loss(x, y)); None:
                                 # the model's CE
    unlock: object = None        # releases out_dir's lock (rank 0)
    commit: str = dataclasses.field(default_factory=git_commit)  # the code's (log_record writes it
                                                                 # once)
    records: int = 0             # metrics.jsonl records this process has written
    run_id: str = dataclasses.field(default_factory=lambda: os.urandom(8).hex())  # this run's, kept by a
                                 # resume: an export made from an earlier run at the same path is told apart

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, checkpoint.LATEST)


def read_config(argv):
    """(the flags given, out_dir, the resumed checkpoint or None, the run's TrainConfig, notes to
    log): the flags on top of the preset, or on top of the saved run's config with --resume=True."""
    overrides = parse_args(argv)
    # the flags alone, no preset: enough to name the run's directory
    given = TrainConfig(**overrides)
    out_dir = os.path.join(given.out_dir, given.run_name or stage_dir(given.stage))
    resume, saved, notes = None, None, []
    if given.resume:  # the saved run's config, the flags given now on top
        path = os.path.join(out_dir, checkpoint.LATEST)
        if not os.path.exists(path) and checkpoint.numbered(out_dir):  # the link alone lost: its target is the newest
            newest = checkpoint.numbered(out_dir)[-1]
            notes.append(f"note: {path} is missing; resuming from the newest checkpoint, {newest} (the next save "
                         f"links {checkpoint.LATEST} again)")
            path = newest
        if not os.path.exists(path):
            if checkpoint.before_first_save(out_dir):
                die(f"--resume=True: the run in {out_dir} ended before its first checkpoint (only its "
                    f"metrics.jsonl is there), so there is nothing to resume; start it again: the same command "
                    f"with --overwrite=True instead of --resume=True")
            die(f"--resume=True but there is no checkpoint at {path}; start without --resume")
        resume = checkpoint.load(path,
                                 ("model", "model_args", "config", "step", "optimizer", "loader"))
        saved = resume["config"]
        notes.append(check_resume(given, overrides, saved, path, resume["step"]))
    # the stage before began from a pretrained model: its tokenizer
    elif "tokenizer" not in overrides:
        tok = start.previous_stage_tokenizer(given)
        overrides = {**overrides, "tokenizer": tok} if tok is not None else overrides
    return overrides, out_dir, resume, build_config(overrides, base=saved), notes


def open_run(run, notes):
    """Check every input of the run against its outputs, lock out_dir (rank 0): a second run into
    the same out_dir stops here; then log the notes. Returns the teachers' paths."""
    teachers = teacher_paths(run.cfg)
    check_run(run.cfg, run.rt, run.out_dir, teachers)
    for name in (checkpoint.LATEST, "metrics.jsonl"):  # files the run writes: a directory there is not its own
        if os.path.isdir(os.path.join(run.out_dir, name)):
            die(f"{os.path.join(run.out_dir, name)} is a directory, where the run keeps its {name} file; move "
                "it out of the way (nothing was changed)")
    if run.rt.master:
        run.unlock = checkpoint.lock(run.out_dir)
    for line in notes:  # after the refusals above: a refused run prints its error line alone
        if line:
            run.rt.log(line)
    return teachers


def starting_model(run, resume):
    """The tokenizer, a lesson's own stage, the starting weights, the runtime, the seed, autocast,
    the loaders and the starting model (run.start, run.model, ...). Returns (the earlier run's files
    in out_dir, removed by finish() with --overwrite=True; the compute dtype's name)."""
    cfg, rt = run.cfg, run.rt
    earlier = checkpoint.existing_run(run.out_dir) if rt.master and not cfg.resume else []
    if earlier and not cfg.overwrite:
        if checkpoint.before_first_save(run.out_dir):
            die(f"{run.out_dir} already holds a run that ended before its first checkpoint (only "
                "its metrics.jsonl): replace it with --overwrite=True, or keep it and pass another "
                "--run_name")
        die(f"{run.out_dir} already holds a run ({', '.join(earlier[:3])}); continue it with "
            "--resume=True, replace it with --overwrite=True, or keep it and pass another "
            "--run_name")
    try:
        tok = get_tokenizer(cfg.tokenizer)
    # a model's tokenizer transformers cannot load: one line naming the flag
    except (ValueError, ImportError) as e:
        flag = "--init_from" if cfg.tokenizer == cfg.init_from else \
            "--teacher" if cfg.tokenizer in cfg.teacher.split(",") else "--tokenizer"
        die(f"{flag}={cfg.tokenizer}: {e}", 2)
    model_conf = model_config(cfg, tok.vocab_size, tok.eot)
    run.vocab = tok.vocab_size
    run.lesson = seams.stage_lesson(cfg)  # --stage=dlm brings its own start, model shape and loss
    if run.lesson is not None:
        model_conf = run.lesson.model_config(model_conf)
        run.eval_loss = run.lesson.eval_loss
    run.start = start.starting_weights(cfg, model_conf, resume, run.ckpt_path, run.lesson,
                                       run.given)
    if resume is not None and resume["config"].get(checkpoint.RUN_ID):
        run.run_id = resume["config"][checkpoint.RUN_ID]

    rt.start()
    rt.start_wandb(cfg.wandb_project, os.path.relpath(run.out_dir),
                   {**dataclasses.asdict(cfg), "commit": run.commit})
    checkpoint.seed_all(cfg.seed)  # the same on every rank: identical initial weights
    cuda = rt.device_type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cuda
    dtype = auto_dtype(cuda) if cfg.dtype == "auto" else cfg.dtype
    run.autocast = torch.autocast(rt.device_type, dtype=getattr(torch, dtype),
                                  enabled=dtype != "float32")
    run.train_loader, run.val_loaders = loaders.make_loaders(cfg, rt, resume)

    run.model = start.starting_model(run, model_conf)  # its weights; a pretrained model converted
    rt.log(run.start.note)
    return earlier, dtype


def auto_dtype(cuda):
    """--dtype=auto: bfloat16 autocast on a GPU with bf16 units (Ampere and later), float16 on older ones
    (a T4, a V100: bf16 there is emulated and inductor does not compile it; float16 scales its loss,
    train.LossScale), float32 on a CPU."""
    if not cuda:
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def finish(run, earlier, use_compile, dtype):
    """With --overwrite=True, and only now that everything else has loaded, remove the earlier run
    in out_dir; report a pretrained start's conversion cost at step 0; log what the run is."""
    rt, model_conf, cfg = run.rt, run.model.config, run.cfg
    if earlier:
        checkpoint.remove_run(run.out_dir)
        rt.log(f"--overwrite=True: removed the earlier run's {', '.join(earlier)} from "
               f"{run.out_dir}")
    start.report_conversion(run)  # a pretrained start: the conversion's cost at step 0
    rt.log(f"{run.model.get_num_params() / 1e6:.2f}M non-embedding params, "
           f"quant={model_conf.quant}, subln={model_conf.subln}, vocab={model_conf.vocab_size}, "
           f"device={rt.device}, dtype={dtype}, world={rt.world} "
           f"({'FSDP2' if cfg.fsdp and rt.world > 1 else 'DDP' if rt.world > 1 else 'one process'})"
           ", "
           f"global batch {cfg.batch_size} x {cfg.grad_accum} sequences, compile "
           f"{'on' if use_compile else 'off'}")
