"""
Where the lessons plug into train.py. train.py and the concept files import no lesson; they offer
seams, and this file fills them from the lessons' flags (the last group of tools/config.py's
TrainConfig):
  a stage of its own  --stage=dlm: lessons/dlm.py's start (the AR model plus a mask token), model
                      shape (bidirectional attention) and loss (the masked-diffusion loss), in place
                      of the recipe's
  run.callbacks       objects train_step calls each step: watch() -> 0-d tensors it reads with the
                      rest, after_step(step, ok) after the update. --qk_clip_tau / --log_max_logit:
                      QK-clip (lessons/muon_variants.py); --avg_checkpoints: checkpoint averaging
                      (lessons/averaging.py)
  the Muon update     --normuon / --muon_state: NorMuon or 8-bit momentum (lessons/muon_variants.py)
  the SubLN gain      --subln_gain=calibrated on a pretrained model (lessons/subln.py)
Test: python -m pytest tests/test_dlm.py tests/test_muon_variants.py tests/test_averaging.py
"""

import dataclasses
import os

import torch

from tools import checkpoint, outputs
from tools.load import load_gpt
from tools.config import DLM_STAGE
from tools.flags import die


def stage_lesson(cfg):
    """The lesson that brings its own stage (start, model shape, loss), or None for the recipe's
    stages 1-3."""
    return DlmStage(cfg) if cfg.stage == DLM_STAGE else None


def plug_in(run, resume):
    """The lessons this run's flags ask for, attached to run after the model and optimizer are built
    (and before a resumed run's optimizer state is loaded): the Muon variants' update, and the step
    callbacks."""
    cfg = run.cfg
    if cfg.optimizer == "muon" and (cfg.normuon or cfg.muon_state != "fp32"):
        # the same groups; NorMuon / 8-bit momentum for the Muon ones
        from lessons.muon_variants import MuonVariant
        opt = run.optimizer
        run.optimizer = MuonVariant(opt.param_groups, normuon=cfg.normuon, state=cfg.muon_state,
                                    ns_dtype=opt.ns_dtype)
    if cfg.qk_clip_tau > 0 or cfg.log_max_logit:
        from lessons.muon_variants import QKClip
        try:
            # tau 0: the max logit is logged, nothing clipped
            run.callbacks.append(QKClip(run.model, cfg.qk_clip_tau))
        except ValueError as e:  # q/k norms (Qwen3) would undo QK-clip's rescaling
            die(f"--qk_clip_tau={cfg.qk_clip_tau}: {e}", 2)
    if cfg.avg_checkpoints:
        run.average = make_average(run, resume)
        run.callbacks.append(run.average)


def calibrate_subln(model, batches):
    """--subln_gain=calibrated: each SubLN's gain from its input's mean rms (lessons/subln.py)."""
    from lessons.subln import calibrate_subln
    calibrate_subln(model, batches)


def avg_interval(cfg):
    """Steps between the snapshots checkpoint averaging takes: --avg_interval, or by default the
    last decay_frac of the run split into avg_checkpoints intervals (averaging stands in for a WSD
    decay over that window)."""
    return cfg.avg_interval or max(1,
                                   round(cfg.decay_frac * cfg.max_iters / max(cfg.avg_checkpoints,
                                                                              1)))


def make_average(run, resume):
    """--avg_checkpoints: the checkpoint average, restored from resume when it holds one."""
    from lessons.averaging import CheckpointAverage
    cfg, rt = run.cfg, run.rt
    if cfg.fsdp and rt.world > 1:
        die("--avg_checkpoints with --fsdp=True: averaging sharded weights is not implemented; use "
            "DDP", 2)
    average = CheckpointAverage(cfg.avg_checkpoints, avg_interval(cfg), cfg.avg_alpha,
                                cfg.max_iters, run.model)
    if resume is not None and resume.get("average"):
        average.load_state_dict(resume["average"], rt.device)
    rt.log(f"checkpoint averaging: EMA (alpha {cfg.avg_alpha}) of the weights at steps "
           f"{average.steps()}, saved as {os.path.join(run.out_dir, checkpoint.AVERAGED)}")
    return average


class DlmStage:
    """--stage=dlm: convert the trained ternary AR model into a masked-diffusion LM
    (lessons/dlm.py)."""

    EVAL_SEED = 1234  # the masks of every evaluation
    flag = "--stage=dlm"
    compiles = False  # its loss calls run.model with diagnostic hooks (the outlier ratios), never the compiled one

    def __init__(self, cfg):
        self.cfg = cfg

    def model_config(self, conf):
        """One more token (the mask, id = the AR vocabulary size) and bidirectional attention."""
        return dataclasses.replace(conf, vocab_size=conf.vocab_size + 1, causal=False,
                                   doc_mask=False)

    def start(self, model_conf):
        """The stage-2 model (or --init_from) with the mask token added (dlm.add_mask_token): (its
        checkpoint dict, the path it came from, the run's note), which start.starting_weights makes
        the run's Start."""
        from lessons import dlm
        cfg = self.cfg
        path = outputs.auto_init_from(cfg.out_dir, cfg.stage) if cfg.init_from == "auto" else cfg.init_from
        if cfg.init_from == "scratch" or not os.path.exists(path):
            die(f"--stage=dlm converts a trained ternary model; no checkpoint at {path}; make one "
                "with: python train.py --stage=2, or pass --init_from=<its ckpt.pt>")
        ar, ckpt = load_gpt(path)
        if not ckpt["model_args"].get("quant"):
            die(f"{path} is a full-precision model (quant=False); --stage=dlm converts the ternary "
                "stage-2 model: python train.py --stage=2, then --stage=dlm", 2)
        ar_conf = dataclasses.replace(model_conf, vocab_size=model_conf.vocab_size - 1, causal=True,
                                      doc_mask=ckpt["model_args"].get("doc_mask", False))
        checkpoint.check_fits(ckpt["model_args"], ar_conf, path)
        model, mask_id = dlm.add_mask_token(ar, cfg.dlm_mask_init, seed=cfg.seed)
        return ({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, path,
                f"stage dlm: the AR model in {path} with a mask token (id {mask_id}, "
                f"{cfg.dlm_mask_init} init), bidirectional "
                f"attention{', Dream shift' if cfg.dlm_shift else ''}")

    def loss_fn(self, run):
        """The masked-diffusion loss, with the outlier ratios of the mask token and of the other
        tokens at the quantisers' inputs logged beside it."""
        from lessons import dlm
        mask_id = run.model.config.vocab_size - 1

        def dlm_loss(x, y):
            loss, info = dlm.masked_diffusion_loss(run.model, x, mask_id, self.cfg.dlm_shift,
                                                   diagnostics=True)
            return loss, {k: info[k] for k in ("ratio_mask", "ratio_other")}
        return dlm_loss

    def eval_loss(self, run):
        """A fresh loss(x, y) for one evaluation: masks drawn from a generator seeded the same every
        time; the rows of a whole-split sweep that are padding (targets -1) are left out."""
        from lessons import dlm
        gen = torch.Generator(device=run.rt.device).manual_seed(self.EVAL_SEED)
        mask_id = run.model.config.vocab_size - 1

        def loss(x, y):
            rows = (y != -1).all(dim=1)
            if not rows.any():
                return torch.zeros((), device=x.device)
            return dlm.masked_diffusion_loss(run.model, x[rows], mask_id, self.cfg.dlm_shift,
                                             generator=gen)[0]
        return loss
