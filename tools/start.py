"""
Where a run of train.py starts: the three-stage recipe of BitDistill (arXiv 2510.13998, sec. 3: SubLN refinement,
continued pre-training, distillation) turned into "which weights does this run load". train.py's set-up asks
starting_weights once, before the model is built; a pretrained model as published (GPT.from_pretrained) goes
through pretrained_start, which inserts SubLN in front of o_proj and down_proj (unit gain, the paper's; or
--subln_gain=calibrated: g = mean rms of the input, lessons/subln.py).
Test: python -m pytest tests/test_train.py tests/test_convert.py tests/test_fault.py
"""
import dataclasses
import os

from tools import checkpoint, common, plumbing
from tools.flags import die
from tools.plumbing import Start


def starting_weights(cfg, model_conf, resume_ckpt, resume_path, run_lesson=None):
    """The three-stage recipe (after BitDistill, arXiv 2510.13998: SubLN refinement, continued pre-training,
    distillation) decides where a run starts:
      stage 1  the full-precision model with SubLN, from scratch; or --init_from=<an fp checkpoint>: its weights,
               and if it has no SubLN, the SubLN norms are inserted with unit gain (the paper's refinement step)
      stage 2  the stage-1 weights (out/stage1/ckpt.pt) with every hidden matrix now ternary (lambda warms up from
               0, so step 0 computes exactly what stage 1 ended with); from scratch if there is no stage-1 run
      stage 3  the stage-2 student; the frozen stage-1 teacher is loaded by make_loss_fn
      --resume=True, any stage: its own latest checkpoint, continued exactly (weights, optimizer, loader, RNG)
      --init_from=<a pretrained model> (a Hugging Face directory, a hub id or a GGUF file), stage 1 or 2: its weights
               as published, SubLN inserted in front of o_proj and down_proj (unit gain, or --subln_gain=calibrated)
    Every checkpoint is checked against this run's shape before anything is loaded; a run that started from a
    pretrained model keeps that model's architecture (plumbing.adopt_architecture)."""
    if resume_ckpt is not None:
        model_conf = plumbing.adopt_architecture(model_conf, resume_ckpt)
        checkpoint.check_fits(resume_ckpt["model_args"], model_conf, resume_path)
        return Start(resume_ckpt["step"], resume_ckpt, resume_path, model_conf=model_conf,
                     note=f"resuming stage {cfg.stage} from {resume_path} at step {resume_ckpt['step']}")
    if run_lesson is not None:  # a stage of a lesson's own (--stage=dlm)
        return Start(**run_lesson.start(model_conf))
    if cfg.init_from == "scratch" or (cfg.stage == 1 and cfg.init_from == "auto"):
        return Start(note=f"stage {cfg.stage}: training from scratch")
    path = os.path.join(cfg.out_dir, f"stage{cfg.stage - 1}", "ckpt.pt") if cfg.init_from == "auto" else cfg.init_from
    if not os.path.exists(path):
        if cfg.init_from == "auto" and cfg.stage == 2:
            return Start(note=f"stage 2: no stage-1 checkpoint at {path}; training the ternary model from scratch")
        die(f"no checkpoint at {path} to start stage {cfg.stage} from; make it with: "
            f"python train.py --stage={max(cfg.stage - 1, 1)}")
    if common.is_model_source(path):
        return pretrained_start(cfg, model_conf, path)
    common.check_input("--init_from", path)  # an HF export of ours: named as such
    ckpt = checkpoint.load(path)
    model_conf = plumbing.adopt_architecture(model_conf, ckpt)
    checkpoint.check_fits(ckpt["model_args"], model_conf, path)
    if cfg.stage == 3 and not ckpt["model_args"].get("quant"):
        die(f"{path} is a full-precision model (quant=False), and stage 3 distils a ternary student; make the "
            f"student first: python train.py --stage=2 (it starts from stage 1), then run stage 3", 2)
    insert = cfg.stage == 1 and not ckpt["model_args"].get("subln", True) and model_conf.subln
    src = f"stage-{cfg.stage - 1} weights" if cfg.init_from == "auto" else "weights"
    note = f"stage {cfg.stage}: starting from the {src} in {path}" + (" (SubLN inserted with unit gain)" if insert else "")
    lam = checkpoint.saved_lambda(ckpt)
    if cfg.stage == 3 and lam is not None and lam < 1:
        note += (f"; NOTE: that student ended mid lambda warm-up (lambda {lam:.2f}); stage 3 trains it at lambda 1 "
                 f"from its first step. To finish the warm-up first: python train.py --stage=2 --resume=True "
                 f"--max_iters=<more steps>")
    return Start(0, ckpt, path, insert, note, model_conf)


def pretrained_start(cfg, model_conf, source):
    """--init_from=<a pretrained model>: BitDistill's stage 1 on it. Its weights in full precision, and SubLN, an
    RMSNorm in front of o_proj and down_proj, inserted with unit gain (the paper; --subln_gain=calibrated sets each
    to the mean rms of its input instead, build() measures it); in stage 2 every hidden linear is then a BitLinear
    whose lambda warms up from 0. The architecture (GQA, head_dim, q/k norms, MLP width, tied head) is the model's."""
    if cfg.stage not in (1, 2):
        die(f"--init_from={source} is a pretrained model: stage 1 or 2 starts from it (stage 3 distils from it: "
            f"--teacher={source})", 2)
    if cfg.tokenizer in ("byte", "gpt2"):  # ids of another vocabulary would index the wrong embedding rows
        die(f"--tokenizer={cfg.tokenizer} is not the tokenizer of {source}; drop --tokenizer (the model's own is "
            f"the default) and make shards with it: python -m tools.prepare --tokenizer={source} ...", 2)
    fp = plumbing.import_model(source, cfg.block_size, "--init_from")
    if fp.config.vocab_size < model_conf.vocab_size:
        die(f"--tokenizer={cfg.tokenizer} has {model_conf.vocab_size} tokens but {source} only "
            f"{fp.config.vocab_size}; drop --tokenizer (the model's own is the default)", 2)
    arch = dataclasses.replace(fp.config, quant=model_conf.quant, subln=model_conf.subln,
                               doc_mask=model_conf.doc_mask, block_size=model_conf.block_size)
    gain = "calibrated" if cfg.subln_gain == "calibrated" else "unit"
    note = (f"stage {cfg.stage}: starting from the pretrained {source} ({fp.config.n_layer} layers, width "
            f"{fp.config.n_embd}, {fp.config.n_head} heads / {fp.config.n_kv_head or fp.config.n_head} kv heads)"
            + (f", SubLN inserted with {gain} gain" if arch.subln else ""))
    start = Start(0, {"model": fp.state_dict(), "model_args": dataclasses.asdict(arch)}, source, arch.subln, note,
                  arch)
    start.pretrained = fp  # the model as published: build() scores it beside the converted one at step 0
    return start
