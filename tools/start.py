"""
Where a run of train.py starts: the three-stage recipe of BitDistill (arXiv 2510.13998, sec. 3:
SubLN refinement, continued pre-training, distillation) turned into "which weights does this run
load". train.py's set-up asks starting_weights once, before the model is built (a Start), then
starting_model for the model itself. A pretrained model as published (tools/pretrained.py) is
converted by convert_pretrained: the same architecture and weights, every hidden linear a BitLinear,
and SubLN inserted in front of o_proj and down_proj (unit gain, the paper's; or
--subln_gain=calibrated: g = mean rms of the input, lessons/subln.py); report_conversion prints what
that costs at step 0. A run that began from a pretrained model keeps its architecture and tokenizer
in the stages after it. Stage 3's frozen teachers (make_teachers) load here too, beside the student's
start.
Test: python -m pytest tests/test_train.py tests/test_convert.py tests/test_fault.py
"""
import dataclasses
import os
import time
from dataclasses import dataclass

import torch

import data
from distill import BitDistillLoss
from model import GPT, precompute_rope
from quant import set_lambda
from tokenizer import fingerprint, get_tokenizer
from tools import atomic, checkpoint, outputs, prepare, seams
from tools.checks import parse_teacher_weights
from tools.flags import die
from tools.load import load_gpt
from tools.outputs import saved_tokenizer
from tools.metrics import estimate_val_loss
from tools.pretrained import from_pretrained, hf_config_of, is_model_source


@dataclass
class Start:
    step: int = 0              # > 0 when resuming
    ckpt: dict = None          # the checkpoint whose weights the model loads (None: from scratch or
                               # pretrained)
    path: str = ""             # where that checkpoint (or the pretrained model) is
    insert_subln: bool = False  # load fp weights without SubLN; the SubLN gains keep their unit
                                # init
    note: str = ""             # what the run says about it
    model_conf: object = None  # the GPTConfig to build when not the flags' (a pretrained model's
                               # architecture)
    pretrained: object = None  # --init_from=<a pretrained model>: that model as published (GPT, fp,
                               # no SubLN)


# what a pretrained model fixes and no flag sets; vocab_size: its embedding's rows, which can be more than its
# tokenizer's ids (Qwen3: 151,936 for 151,669)
ARCHITECTURE = ("n_layer", "n_head", "n_embd", "n_kv_head", "head_dim", "qk_norm", "mlp_hidden", "rope_theta",
                "norm_eps", "tie_embeddings", "vocab_size")


def starting_weights(cfg, model_conf, resume_ckpt, resume_path, run_lesson=None, given=None):
    """The three-stage recipe (after BitDistill, arXiv 2510.13998: SubLN refinement, continued
    pre-training, distillation) decides where a run starts:
      stage 1  the full-precision model with SubLN, from scratch; or --init_from=<an fp checkpoint>:
               its weights, and if it has no SubLN, the SubLN norms are inserted with unit gain (the
               paper's refinement step)
      stage 2  the stage-1 weights (out/stage1/ckpt.pt) with every hidden matrix now ternary (lambda
               warms up from 0, so step 0 computes exactly what stage 1 ended with); from scratch if
               there is no stage-1 run
      stage 3  the stage-2 student; the frozen stage-1 teacher is loaded by make_loss_fn
      --resume=True, any stage: its own latest checkpoint, continued exactly (weights, optimizer,
               loader, RNG)
      --init_from=<a pretrained model> (a Hugging Face directory, a hub id or a GGUF file), stage 1
               or 2: its weights as published, SubLN inserted in front of o_proj and down_proj
               (unit gain, or --subln_gain=calibrated)
    Every checkpoint is checked against this run's shape before anything is loaded; a run that
    started from a pretrained model keeps that model's architecture (adopt_architecture). given: the
    flags given on the command line, {name: value}; an architecture flag that the model's
    architecture overrules is refused (check_given)."""
    if resume_ckpt is not None:
        check_saved_tokenizer(cfg, resume_ckpt, resume_path)
        model_conf = adopt_architecture(model_conf, resume_ckpt, given, resume_path)
        checkpoint.check_fits(resume_ckpt["model_args"], model_conf, resume_path)
        moved = shipped_of_moved_model(cfg, resume_ckpt, given)
        return Start(resume_ckpt["step"], resume_ckpt, resume_path, model_conf=model_conf,
                     note=f"resuming stage {cfg.stage} from {resume_path} at step "
                          f"{resume_ckpt['step']}" + moved)
    # a stage of a lesson's own (--stage=dlm): (checkpoint, its path, the note)
    if run_lesson is not None:
        ckpt, path, note = run_lesson.start(model_conf)
        return Start(0, ckpt, path, note=note)
    if cfg.init_from == "scratch" or (cfg.stage == 1 and cfg.init_from == "auto"):
        return Start(note=f"stage {cfg.stage}: training from scratch")
    path = outputs.auto_init_from(cfg.out_dir, cfg.stage) if cfg.init_from == "auto" else cfg.init_from
    # a hub id is no path: from_pretrained fetches it
    if not os.path.exists(path) and not is_model_source(path):
        if cfg.init_from == "auto" and cfg.stage == 2:
            return Start(note=f"stage 2: no stage-1 checkpoint at {path}; training the ternary "
                              "model from scratch")
        # a path the user typed: say it is not there, not how to make a stage
        if cfg.init_from != "auto":
            where = os.path.dirname(path) or "."
            near = f" ({where} holds {', '.join(sorted(os.listdir(where))[:4])})" if os.path.isdir(where) else \
                f" (no directory {where})"
            die(f"--init_from={path}: no such file or directory{near}; pass the checkpoint "
                f"(ckpt.pt), pretrained model (a directory, a .gguf) or hub id to start from", 2)
        die(f"no checkpoint at {path} to start stage {cfg.stage} from; make it with: "
            f"python train.py --stage={max(cfg.stage - 1, 1)}")
    if is_model_source(path):
        return pretrained_start(cfg, model_conf, path, given)
    outputs.check_input("--init_from", path)  # an HF export of ours: named as such
    ckpt = checkpoint.load(path, required=("model_args",))
    check_starts_this_stage(cfg, ckpt, path)
    ckpt = checkpoint.load(path)
    check_saved_tokenizer(cfg, ckpt, path, given)
    model_conf = adopt_architecture(model_conf, ckpt, given, path)
    checkpoint.check_fits(ckpt["model_args"], model_conf, path)
    if cfg.stage == 3 and not ckpt["model_args"].get("quant"):
        die(f"{path} is a full-precision model (quant=False), and stage 3 distils a ternary "
            "student; make the student first: python train.py --stage=2 (it starts from stage 1), "
            "then run stage 3", 2)
    insert = cfg.stage == 1 and not ckpt["model_args"].get("subln", True) and model_conf.subln
    src = f"stage-{cfg.stage - 1} weights" if cfg.init_from == "auto" else "weights"
    note = f"stage {cfg.stage}: starting from the {src} in {path}" + (" (SubLN inserted with unit "
                                                                      "gain)" if insert else "")
    lam = checkpoint.saved_lambda(ckpt)
    if cfg.stage == 3 and lam is not None and lam < 1:
        note += (f"; NOTE: that student ended mid lambda warm-up (lambda {lam:.2f}); stage 3 "
                 "trains it at lambda 1 from its first step. To finish the warm-up first: python "
                 f"train.py --stage=2 --resume=True --max_iters=<more steps>")
    return Start(0, ckpt, path, insert, note, model_conf)


def check_starts_this_stage(cfg, ckpt, path):
    """Refuse, naming what the file is and what to pass, an --init_from that no stage of train.py
    starts from (a packed export, made for inference) or that this stage does not (a
    masked-diffusion checkpoint; a ternary checkpoint into stage 1, which trains the full-precision
    model)."""
    if str(ckpt.get("format", "")).startswith("nanobitnet-packed"):
        source = ckpt.get("source")
        die(f"--init_from={path} is a packed export (tools/export.py: frozen ternary codes for "
            f"sample.py), not a training checkpoint; pass the checkpoint it was exported from"
            + (f": --init_from={source}" if source else " (its ckpt.pt)"), 2)
    args = ckpt["model_args"]
    if not args.get("causal", True):
        die(f"--init_from={path} is a masked-diffusion checkpoint (--stage=dlm), and stage "
            f"{cfg.stage} trains a causal model; sample it with sample.py --ckpt={path} "
            f"--dlm=True, or start stage {cfg.stage} from the causal checkpoint it was converted "
            "from", 2)
    if cfg.stage == 1 and args.get("quant"):
        die(f"--init_from={path} is a ternary (quant=True) checkpoint, and stage 1 trains the "
            "full-precision model; continue it in stage 2 (python train.py --stage=2 "
            f"--init_from={path}), or start stage 1 from a full-precision checkpoint (a stage-1 "
            "ckpt.pt)", 2)


def shipped_of_moved_model(cfg, ckpt, given):
    """--resume=True --tokenizer=<the run's model at a new path>: a shipped corpus
    (--data=shakespeare) the run read was tokenised into data/<corpus>_<model>-<hash of the model's
    old path>, and the new path names another directory. Unless --data is given, cfg.data becomes
    the directories the saved loader state names, so the run continues on the shards it was reading;
    returns what the run's note says about it ("" if nothing changed)."""
    saved = (ckpt.get("config") or {}).get("tokenizer")
    dirs = (ckpt.get("loader") or {}).get("dirs") or []
    if saved in (None, cfg.tokenizer) or "data" in (given or {}) or not dirs:
        return ""
    paths = [os.path.join(atomic.ROOT, "data", d) for d in dirs]
    shipped = [d.split("_")[0] in prepare.CORPORA and os.path.isdir(p) for d, p in zip(dirs, paths)]
    if not all(shipped):
        # not all shipped corpora: --data names directories, which moving a model does not rename
        return ""
    items = str(ckpt["config"].get("data") or "").split(",")
    weighted = len(items) == len(paths) and all(":" in item for item in items)
    cfg.data = ",".join(f"{p}:{item.rpartition(':')[2]}" if weighted else p
                        for p, item in zip(paths, items * len(paths)))
    return (f"; the model moved from {saved}: the shipped corpus' shards it made are read again "
            f"(--data={cfg.data})")


def check_saved_tokenizer(cfg, ckpt, path, given=None):
    """Refuse a run whose tokenizer is not the vocabulary the checkpoint at path was trained on (the
    fingerprint its config records; a checkpoint without one: checkpoint.check_fits compares the
    vocabulary's size). A stage-3 student whose vocabulary is not its pretrained teacher's (whose
    tokenizer the run took, none given) is told to start from a student converted from that
    teacher."""
    saved = (ckpt.get("config") or {}).get("tokenizer_fingerprint")
    if saved and saved != fingerprint(get_tokenizer(cfg.tokenizer)):
        was = ckpt["config"].get("tokenizer")
        teacher = str(cfg.teacher or "").split(",")[0]
        if cfg.stage == 3 and cfg.tokenizer == teacher and "tokenizer" not in (given or {}):
            die(f"the student {path} (--init_from={cfg.init_from}) was trained with the tokenizer "
                f"{was}, not the vocabulary of the teacher {teacher}; distil a student converted "
                "from it: --init_from=<the ckpt.pt of python train.py --stage=2 "
                f"--init_from={teacher} --out_dir=<its own>>, or pass the --out_dir of that run", 2)
        die(f"--tokenizer={cfg.tokenizer} is not the tokenizer {path} was trained with ({was}, "
            f"fingerprint {saved}, against {fingerprint(get_tokenizer(cfg.tokenizer))}); pass "
            f"--tokenizer=<that model> (its own file, wherever it is now)", 2)


def adopt_architecture(model_conf, ckpt, given=None, path=""):
    """The model config a run starting from ckpt builds: the flags' (model_conf), except that a
    checkpoint of a run that began from a pretrained model (its tokenizer is that model's) keeps
    that model's architecture; a flag given for it that says otherwise is refused (check_given)."""
    tok = (ckpt.get("config") or {}).get("tokenizer", "byte")
    if tok in ("byte", "gpt2"):
        return model_conf
    args = ckpt["model_args"]
    conf = dataclasses.replace(model_conf, **{k: args[k] for k in ARCHITECTURE if k in args})
    check_given(given, conf, f"{path}, a run that began from the pretrained {tok},")
    try:  # the model's trained context: RoPE past it gives no error, only wrong numbers
        context = hf_config_of(tok)[2].max_position_embeddings if is_model_source(tok) else None
    except ValueError:  # the model moved or is unreadable: check_saved_tokenizer says so
        context = None
    if context and conf.block_size > context:
        die(f"--block_size={conf.block_size} is longer than the context of {tok} ({context} "
            f"positions, its max_position_embeddings), which {path} began from; pass "
            f"--block_size={context} or less", 2)
    return conf


def check_given(given, conf, what):
    """The architecture flags given ({name: value}) that conf, a pretrained model's architecture,
    overrules: one error line each where the flag asks for another value (what: the model or
    checkpoint, for the message)."""
    given = given or {}
    for key in ("n_layer", "n_head", "n_embd"):
        if key in given and given[key] != getattr(conf, key):
            die(f"--{key}={given[key]}: {what} has {key}={getattr(conf, key)}, and a pretrained "
                f"model keeps its architecture; drop --{key}", 2)
    if given.get("pad_vocab") and conf.vocab_size % 64:
        die(f"--pad_vocab=True: {what} has its own vocabulary of {conf.vocab_size} tokens, kept as "
            f"it is; drop --pad_vocab", 2)


def previous_stage_tokenizer(cfg):
    """--init_from=auto in stage 2 or 3: the tokenizer the previous stage's checkpoint was trained
    with when it began from a pretrained model (that model's own), else None."""
    if cfg.init_from != "auto" or cfg.stage not in (2, 3):
        return None
    path = outputs.auto_init_from(cfg.out_dir, cfg.stage)
    if not os.path.exists(path):
        return None
    try:
        tok = (checkpoint.load(path, ("config",), mmap=True).get("config") or {}).get("tokenizer")
    except checkpoint.CheckpointError:
        return None  # starting_weights says what is wrong with it
    return tok if is_model_source(tok or "") else None


# -----------------------------------------------------------------------------
# a pretrained model: imported as published, converted, and what the conversion costs


def pretrained_start(cfg, model_conf, source, given=None):
    """--init_from=<a pretrained model>: BitDistill's stage 1 on it (convert_pretrained, run by
    starting_model); in stage 2 every hidden linear is then a BitLinear whose lambda warms up from
    0. The architecture (GQA, head_dim, q/k norms, MLP width, tied head) is the model's; quant,
    subln, doc_mask and block_size are the run's."""
    if cfg.stage not in (1, 2):
        die(f"--init_from={source} is a pretrained model: stage 1 or 2 starts from it (stage 3 "
            f"distils from it: --teacher={source})", 2)
    # ids of another vocabulary would index the wrong embedding rows
    if cfg.tokenizer in ("byte", "gpt2"):
        die(f"--tokenizer={cfg.tokenizer} is not the tokenizer of {source}; drop --tokenizer (the "
            "model's own is the default) and make shards with it: python -m tools.prepare "
            f"--tokenizer={source} ...", 2)
    check_same_tokenizer("--tokenizer", cfg.tokenizer, "the tokenizer of "
                                                       f"--init_from={source}", source)
    fp = import_model(source, cfg.block_size, "--init_from", check=lambda conf: check_given(given, conf, source))
    if fp.config.vocab_size < model_conf.vocab_size:
        die(f"--tokenizer={cfg.tokenizer} has {model_conf.vocab_size} tokens but {source} only "
            f"{fp.config.vocab_size}; drop --tokenizer (the model's own is the default)", 2)
    # eot: the run's tokenizer's (what tools/prepare.py starts each document with), not the config's
    # eos
    arch = dataclasses.replace(fp.config, quant=model_conf.quant, subln=model_conf.subln,
                               doc_mask=model_conf.doc_mask, block_size=model_conf.block_size, eot=model_conf.eot)
    gain = "calibrated" if cfg.subln_gain == "calibrated" else "unit"
    note = (f"stage {cfg.stage}: starting from the pretrained {source} ({fp.config.n_layer} "
            f"layers, width {fp.config.n_embd}, {fp.config.n_head} heads / "
            f"{fp.config.n_kv_head or fp.config.n_head} kv heads)"
            + (f", SubLN inserted with {gain} gain" if arch.subln else ""))
    if cfg.stage == 2 and not cfg.quant_start and cfg.lambda_warmup_steps > cfg.max_iters:
        note += (f"; NOTE: lambda reaches 1 at step {cfg.lambda_warmup_steps} "
                 f"(--lambda_warmup_steps), after this run's last step ({cfg.max_iters}), so the "
                 "model it saves is not ternary yet; for a short run pass "
                 f"--lambda_warmup_steps={max(cfg.max_iters // 2, 1)} (half the run, as "
                 "lab/tables.py's SmolLM2 rows)")
    return Start(0, None, source, note=note, model_conf=arch, pretrained=fp)


def check_same_tokenizer(flag, name, what, other, fix=None):
    """Refuse (one line) a run whose tokenizer (flag=name) is not other's vocabulary: ids of one
    read as the other's tokens. Compared by fingerprint (tokenizer.fingerprint), so two paths to one
    model agree."""
    if name == other or (os.path.exists(name) and os.path.exists(other) and os.path.samefile(name, other)):
        return
    try:
        mine, theirs = get_tokenizer(name), get_tokenizer(other)
    except (ValueError, OSError, ImportError) as e:
        die(f"{flag}={name}: {e}", 2)
    if fingerprint(mine) != fingerprint(theirs):
        die(f"{flag}={name} is not {what} ({other}): the vocabularies differ ({mine.vocab_size} "
            f"tokens, fingerprint {fingerprint(mine)}, against {theirs.vocab_size}, "
            f"{fingerprint(theirs)}); "
            + (fix or f"pass {flag}={other}, and shards made with it (python -m tools.prepare "
                      f"--tokenizer={other})"), 2)


def import_model(source, block_size, flag, check=None):
    """A pretrained model as published (tools/pretrained.py: full precision, no SubLN); a model we
    cannot carry is one error line naming the config field. check(its GPTConfig): the caller's
    refusals, before any weight is read."""
    files = [source] if os.path.isfile(source) else \
        [os.path.join(source, n) for n in os.listdir(source)] if os.path.isdir(source) else []
    size = sum(os.path.getsize(f) for f in files)
    t0 = time.time()
    print(f"{flag}={source}: loading the model with transformers ({size / 1e6:,.0f} MB on disk"
          + (", dequantised to float32" if source.endswith(".gguf") else "") + ")", flush=True)
    try:
        model = from_pretrained(source, block_size=block_size, check=check)
    except (ValueError, OSError) as e:
        die(f"{flag}={source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", 2)
    print(f"{flag}={source}: loaded, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters (float32) in {time.time() - t0:.0f} s", flush=True)
    return model


def convert_pretrained(fp, conf=None, batches=None, device=None):
    """BitDistill's stage-1 conversion: a pretrained model as published (fp: GPT, full precision, no
    SubLN) -> a new GPT of conf (default: fp's config with quant=True, subln=True) holding fp's
    weights; every hidden linear a BitLinear when conf.quant (lambda_ as built, 1: set_lambda before
    use); with conf.subln an RMSNorm in front of o_proj and down_proj, unit gain (the paper), or
    given batches [(x, y), ...] each gain the mean rms of its input over them in the model as
    published (lessons/subln.py: measured at lambda 0, lambda_ left as built), on device if given (the
    run's GPU: the model moves there first). fp is left as it was."""
    conf = conf or dataclasses.replace(fp.config, quant=True, subln=True)
    model = GPT(conf)
    checkpoint.load_weights(model, fp.state_dict(), getattr(fp, "source", "the pretrained "
                                                                          "model"), conf.subln)
    if batches is not None and conf.subln:
        if device is not None:
            model.to(device)
            batches = [(x.to(device), y if y is None else y.to(device)) for x, y in batches]
        seams.calibrate_subln(model, batches)
    return model


def starting_model(run, model_conf):
    """The model a run begins with, as run.start says: model_conf's (or the start's own
    architecture) with the starting checkpoint's weights, or the pretrained model converted
    (--subln_gain=calibrated: measured on the run's first training batches, calibration_batches)."""
    st, cfg = run.start, run.cfg
    conf = st.model_conf or model_conf
    if st.pretrained is not None:
        calibrate = conf.subln and cfg.subln_gain == "calibrated"
        batches = calibration_batches(cfg, run.train_loader) if calibrate else None
        return convert_pretrained(st.pretrained, conf, batches, run.rt.device)
    model = GPT(conf)
    if st.ckpt is not None:
        checkpoint.load_weights(model, st.ckpt["model"], st.path, st.insert_subln)
    return model


def calibration_batches(cfg, train_loader, n=8):
    """The first n training batches of a fresh sequential loader over the run's data (the run's own
    loader, and so its position and RNG, untouched): what --subln_gain=calibrated measures."""
    sources = dict(zip(train_loader.dirs, train_loader.weights.tolist()))
    loader = data.DataLoader(sources, "train", cfg.batch_size, cfg.block_size, order="sequential")
    return [loader.next_batch() for _ in range(n)]


def report_conversion(run):
    """A run that starts from a pretrained model logs what the conversion costs before any training:
    the val loss of the converted model at lambda 0 beside the model's as published, on the same val
    rows. Then the published model is freed (a teacher is loaded apart)."""
    st = run.start
    if st.pretrained is None:
        return
    set_lambda(run.model, 0.0)
    run.rt.log(f"step 0: scoring {st.path} as published and converted (lambda 0) on the val split: "
               f"what the conversion costs, before any training")
    fp = estimate_val_loss(run, model=st.pretrained.to(run.rt.device))[0]
    subln = f" with SubLN ({run.cfg.subln_gain} gain)" if run.model.config.subln else ""
    run.rt.log(f"step 0: val loss {estimate_val_loss(run)[0]:.4f} at lambda 0{subln}, against "
               f"{fp:.4f} for {st.path} as published")
    st.pretrained = None


# -----------------------------------------------------------------------------
# stage 3's teachers: frozen full-precision models, and the BitDistill loss against them


def make_teachers(cfg, paths, student_conf, device, vocab=None):
    """Stage 3: the frozen full-precision teachers (eval mode, no grad, bf16 on CUDA) and the
    BitDistill loss (its logits KD over the tokenizer's vocab ids, not --pad_vocab's padding rows).
    With every distillation weight 0 there is no teacher: ([], crit), plain CE, the control run."""
    try:
        crit = BitDistillLoss(cfg.distill_preset,
                              kd_logits=None if cfg.kd_logits < 0 else cfg.kd_logits,
                              kd_relation=None if cfg.kd_relation < 0 else cfg.kd_relation,
                              kd_hidden=cfg.kd_hidden, temperature=cfg.distill_tau,
                              n_relation_heads=cfg.distill_relation_heads,
                              distill_layer=cfg.distill_layer,
                              teacher_weights=parse_teacher_weights(cfg, len(paths)), vocab=vocab)
    except ValueError as e:
        die(str(e), 2)
    if crit.kd_logits == crit.kd_relation == crit.kd_hidden == 0:
        return [], crit
    return [_load_teacher(cfg, crit, p, student_conf, device, first=i == 0) for i,
            p in enumerate(paths)], crit


def _load_teacher(cfg, crit, path, student_conf, device, first):
    # the original model as published (BitDistill's teacher): full precision, no SubLN
    if is_model_source(path):
        check_same_tokenizer("--tokenizer", cfg.tokenizer, "the tokenizer of the --teacher", path)
        teacher = import_model(path, cfg.block_size, "--teacher")
        check_teacher(cfg, crit, student_conf, teacher.config, path, first)
        return _frozen(teacher, student_conf, device)
    outputs.check_input("--teacher", path)  # an HF export of ours: named as such
    if not checkpoint.load(path, ("model_args",), mmap=True)["model_args"].get("causal", True):
        die(f"{path}: a masked-diffusion model (--stage=dlm) cannot be a teacher: stage 3 distils "
            "next-token predictions; pass a stage-1 (or any autoregressive) checkpoint as "
            "--teacher", 2)
    teacher, obj = load_gpt(path)
    # the teacher's ids are the student's: one vocabulary, not only one size
    if saved_tokenizer(obj):
        check_same_tokenizer("--tokenizer", cfg.tokenizer, f"the tokenizer of the --teacher {path}",
                             saved_tokenizer(obj))
    tconf = teacher.config
    # shapes that would only fail at the first step
    check_teacher(cfg, crit, student_conf, tconf, path, first)
    return _frozen(teacher, student_conf, device)


def _frozen(teacher, student_conf, device):
    """The teacher as stage 3 runs it: frozen, seeing each token's context as the student does (its
    --doc_mask, documents starting at the run's eot: an imported config has neither), bf16 on CUDA."""
    teacher.config = dataclasses.replace(teacher.config, doc_mask=student_conf.doc_mask, eot=student_conf.eot)
    tconf = teacher.config
    teacher.requires_grad_(False).eval()
    if device.startswith("cuda"):  # weights in bf16, cast before the move: the GPU never holds the fp32 copy
        teacher.to(torch.bfloat16)
    teacher.to(device)
    if device.startswith("cuda"):  # RoPE tables stay fp32
        cos, sin = precompute_rope(tconf.head_size(), tconf.block_size, tconf.rope_theta)
        teacher.rope_cos, teacher.rope_sin = cos.to(device), sin.to(device)
    return teacher


def check_teacher(cfg, crit, s, t, path, first=True):
    """Stage 3 settings that only fail at the first step, refused before training: another
    vocabulary, a
    --distill_layer outside either model, relation heads that do not divide both widths, a context
    longer than the teacher's. Only the first teacher gives relations and hidden states
    (first=False: the others)."""
    if t.vocab_size != s.vocab_size:
        die(f"{path}: teacher vocabulary {t.vocab_size} != student {s.vocab_size}; the same "
            "--tokenizer is needed")
    try:
        crit.layer_index(s.n_layer), crit.layer_index(t.n_layer) if first else None
    except ValueError as e:  # --distill_layer outside one of the models
        die(str(e), 2)
    heads = crit.n_relation_heads
    widths = sorted({c.n_head * c.head_size() for c in (s, t)} |
                    {c.kv_heads() * c.head_size() for c in (s, t)})
    # q's width, and k's and v's under GQA
    if first and crit.kd_relation and any(w % heads for w in widths):
        fits = max(a for a in range(1, heads + 1) if all(w % a == 0 for w in widths))
        die(f"--distill_relation_heads={heads} must divide the widths of the student's and the "
            f"teacher's q, k and v ({', '.join(map(str, widths))}); try "
            f"--distill_relation_heads={fits}", 2)
    if cfg.block_size > t.block_size:
        die(f"--block_size={cfg.block_size} is longer than the teacher's context ({t.block_size} "
            f"in {path}); pass --block_size={t.block_size} or less", 2)
