"""
Sample text from a trained checkpoint.

  python sample.py                              (out/stage2/ckpt.pt, default prompt)
  python sample.py --ckpt=out/stage1/ckpt.pt --start="ROMEO:" --max_new_tokens=300 --temperature=0.8
  python sample.py --packed=True                (ternary model run from 2-bit packed weights)
  python sample.py --ckpt=out/stage2/packed.pt  (a packed export from tools/export.py)
  python sample.py --decode=eager               (on CUDA too: model.generate, no CUDA graph)
  python sample.py --dlm=True                   (out/dlm/ckpt.pt, the masked-diffusion model:
                                                 dlm.generate fills --max_new_tokens masks in
                                                 --steps steps, choosing which to keep by
                                                 --remasking=random or low_confidence)
  python sample.py --ckpt=out/stage1/ckpt.pt --jsonl=teacher.jsonl --num_samples=256 \
      --max_new_tokens=256 --temperature=1 --top_k=50257
      (a corpus of teacher-written documents; shard it with tools/prepare.py, then mix it in:
       --data=data/shakespeare_byte:0.8,data/teacher:0.2)

The tokenizer and model shape come from the checkpoint, so any stage's ckpt.pt works. With
--packed=True every BitLinear is frozen to 2-bit codes plus gamma (kernels/packed_linear.py) before
sampling: the fp latent weights are dropped and the integer inference path runs (Triton on CUDA,
torch on CPU). Decoding runs from a static KV cache (tools/decode.py): on CUDA one captured decode
step is replayed per token (--decode=graph, the default there; compile adds torch.compile),
elsewhere model.generate's eager step; --decode=eager on CUDA too. Greedy decoding is --top_k=1;
--temperature must be a finite number >= 1e-6 (0 is refused, not read as greedy).
--dlm=True fills prompt and continuation in one block_size context: a longer --max_new_tokens is
refused.

Test: python -m pytest tests/test_sample.py tests/test_packed.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

from tools import atomic, checkpoint, decode, outputs
from tokenizer import get_tokenizer
from lessons import dlm
from tools.load import PACKED, load_gpt, packed_kernels
from tools.outputs import saved_tokenizer
from tools.flags import die, parse
from tools.runtime import check_device

@dataclass
class SampleConfig:
    ckpt: str = "out/stage2/ckpt.pt"  # a training checkpoint (any stage) or a packed export; --dlm:
                                      # out/dlm/ckpt.pt
    start: str = "\n"             # the prompt; FILE:path reads it from a UTF-8 file (nanoGPT's)
    num_samples: int = 2         # samples to print (or documents to write with --jsonl)
    max_new_tokens: int = 200    # tokens generated per sample (--dlm: at most block_size minus the
                                 # prompt)
    temperature: float = 0.8     # >= 1e-6; for greedy decoding use --top_k=1
    top_k: int = 50              # sample among the k likeliest tokens; 1 = greedy
    seed: int = 1337             # seeds the sampling
    device: str = "auto"         # auto = cuda if available, else cpu; or cpu, cuda, cuda:<index>
    packed: bool = False         # freeze every BitLinear to 2-bit codes + gamma and run the integer
                                 # path
    decode: str = "auto"         # auto = graph on CUDA, else eager; eager, fixed, graph, compile
                                 # (tools/decode.py)
    jsonl: str = ""              # write num_samples documents to this .jsonl (a teacher-written
                                 # corpus) instead
    overwrite: bool = False      # --jsonl: replace an existing file there
    dlm: bool = False            # the checkpoint is a masked-diffusion model (--stage=dlm): fill
                                 # masks, not next tokens
    steps: int = 64              # --dlm: denoising steps
    remasking: str = "random"    # --dlm: which predictions to keep each step: random or
                                 # low_confidence


def load_model(path, device, packed=False):
    """(model, tokenizer) from a training checkpoint, an average or a packed export (load.load_gpt);
    packed=True freezes the former to 2-bit codes and gamma."""
    try:
        model, obj = load_gpt(path)
    # missing, truncated, corrupt or foreign: one line naming the file
    except checkpoint.CheckpointError as e:
        die(str(e))
    if saved_tokenizer(obj) is None:
        die(f"{path}: no tokenizer in its config; sample a checkpoint that train.py or "
            "tools/export.py wrote")
    tok = get_tokenizer(saved_tokenizer(obj))  # load_gpt checked that it fits the vocabulary
    if str(obj.get("format", "")).startswith(PACKED):  # load_gpt imported the kernels for it
        pk = packed_kernels()
        print(pk.bytes_line(pk.weight_bytes(model)) + " (packed export)")
    elif packed:
        try:
            pk = packed_kernels()
            latent = pk.weight_bytes(model)
            pk.freeze_ternary(model)
        except ValueError as e:
            die(f"{path}: --packed=True: {e}")
        print(pk.bytes_line(pk.weight_bytes(model), latent))
    return model.to(device).eval(), tok


def main(argv):
    args = dataclasses.asdict(SampleConfig(**parse(argv, SampleConfig, __doc__)))
    _check_args(args)
    device = args["device"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device.startswith("cuda:"):  # Triton kernels and CUDA graphs run on the current device ("cuda" is it)
        torch.cuda.set_device(device)
    torch.manual_seed(args["seed"])
    if args["dlm"] and args["ckpt"] == SampleConfig.ckpt:
        args["ckpt"] = os.path.join("out", "dlm", checkpoint.LATEST)
    model, tok = load_model(args["ckpt"], device, args["packed"])
    stale_export_note(args["ckpt"])
    if args["dlm"] != (not model.config.causal):
        die(f"{args['ckpt']} is "
            f"{'an autoregressive' if model.config.causal else 'a masked-diffusion'} model; sample "
            f"it with --dlm={'False' if model.config.causal else 'True'}", 2)
    if args["dlm"]:
        return sample_dlm(model, tok, args, device)
    if args["jsonl"]:
        with atomic.stoppable("--jsonl", args["jsonl"]):
            n = write_corpus(model, tok, args["jsonl"], args["num_samples"], args["max_new_tokens"],
                             args["temperature"], args["top_k"], args["start"], mode=args["decode"])
        print(f"wrote {args['num_samples']} samples, {n} characters, to {args['jsonl']}")
        return
    ids = [tok.eot] + tok.encode(args["start"])  # documents start with end-of-text in the shards
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, ...]
    # one static cache (and CUDA graph) for every sample
    decoder = decode.Decoder(model, args["decode"])
    for _ in range(args["num_samples"]):
        y = decoder.generate(x, args["max_new_tokens"], temperature=args["temperature"],
                             # a --pad_vocab model's padding rows are no token
                             top_k=args["top_k"], vocab=tok.vocab_size)
        print(tok.decode(y[0, 1:].tolist()))
        print("---------------")


def stale_export_note(path):
    """A packed export beside a training checkpoint of another run (train.py --overwrite=True since it was
    exported): one note on stderr, since the samples are the earlier run's model."""
    beside = os.path.join(os.path.dirname(path) or ".", checkpoint.LATEST)
    if outputs.file_kind(path)[0] != "packed" or not os.path.exists(beside):
        return
    if not outputs.same_run(path, "packed", beside):
        made, now = outputs.export_run(path, "packed"), outputs.checkpoint_run(beside)
        print(f"note: {path} was exported from an earlier run than {beside} (run {made}, not {now}): these are the "
              f"earlier model's samples; re-export it: python -m tools.export --ckpt={beside} --out={path} "
              "--overwrite=True", file=sys.stderr)


def sample_dlm(model, tok, args, device):
    """--dlm=True: prompt + masks, filled by dlm.generate within block_size, k tokens a step, the k
    kept chosen by
    --remasking: random (the default: low_confidence writes only spaces with our small models,
    README)."""
    ids = [tok.eot] + tok.encode(args["start"])
    gen_len, room = args["max_new_tokens"], model.config.block_size - len(ids)
    if room < 1:
        die(f"--start is {len(ids)} tokens, which leaves no room in block_size "
            f"{model.config.block_size}", 2)
    # before sampling: the whole continuation is filled inside one context window
    if gen_len > room:
        die(f"--max_new_tokens={gen_len}: a masked-diffusion model fills prompt and continuation "
            f"in one context of block_size {model.config.block_size}, and the prompt takes "
            f"{len(ids)} (end-of-text and --start); pass --max_new_tokens={room} or less", 2)
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, ...]
    g = torch.Generator(device=device).manual_seed(args["seed"])
    for _ in range(args["num_samples"]):
        y = dlm.generate(model, x, gen_len, min(args["steps"], gen_len),
                         model.config.vocab_size - 1, shift=model.dlm_shift,
                         temperature=args["temperature"], top_k=args["top_k"],
                         remasking=args["remasking"], generator=g, vocab=tok.vocab_size)
        print(tok.decode(y[0, 1:].tolist()))
        print("---------------")


def write_corpus(model, tok, path, num_samples, max_new_tokens, temperature=1.0, top_k=None,
                 start="", batch_size=64, mode="auto", flag="--jsonl"):
    """Teacher-generated data: num_samples documents sampled from the model, each cut at its first
    end-of-text, written as jsonl ({"text": ...} per line, tools/prepare.py's input), all or nothing
    (atomic.written: a full disk is one error line naming flag, or the path alone with flag=None). mode: tools/decode.py's. Returns the
    number of characters written."""
    # a document starts after end-of-text
    ids = torch.tensor([tok.eot] + tok.encode(start), dtype=torch.long)
    device = next(model.parameters()).device
    chars, decoder = 0, decode.Decoder(model, mode)
    with atomic.written(path, flag) as tmp, open(tmp, "w") as f:
        for i in range(0, num_samples, batch_size):
            x = ids.to(device).expand(min(batch_size, num_samples - i), -1)
            y = decoder.generate(x, max_new_tokens, temperature=temperature, top_k=top_k,
                                 vocab=tok.vocab_size)[:, 1:].tolist()
            for row in y:
                # the model ended the document
                row = row[:row.index(tok.eot)] if tok.eot in row else row
                text = tok.decode(row)
                chars += len(text)
                f.write(json.dumps({"text": text}) + "\n")
    return chars


# -----------------------------------------------------------------------------
# checks: every flag before any checkpoint is read (a value that would sample nothing or nonsense,
# crash
# mid-generation, or write over a file that must be kept stops here)


MIN_TEMPERATURE = 1e-6  # model.generate's floor on the temperature (max(temperature, 1e-6))


def _check_args(args):
    for key in ("num_samples", "max_new_tokens", "top_k", "steps"):
        if args[key] < 1:
            greedy = " (--top_k=1 is greedy decoding)" if key == "top_k" else ""
            die(f"--{key}={args[key]}: expected an integer >= 1{greedy}", 2)
    t = args["temperature"]
    # generate() would turn 0 or less into greedy decoding without a word
    if not (math.isfinite(t) and t > 0):
        die(f"--temperature={t:g}: expected a finite number > 0; for greedy decoding use --top_k=1",
            2)
    if t < MIN_TEMPERATURE:  # one rule for both samplers (dlm.generate takes any temperature >= 0)
        die(f"--temperature={t:g}: expected at least {MIN_TEMPERATURE:g}, the smallest temperature "
            f"model.generate samples at (below it, it would use {MIN_TEMPERATURE:g} without a "
            "word); for greedy decoding use --top_k=1", 2)
    if args["decode"] not in ("auto",) + decode.MODES:
        die(f"--decode={args['decode']}: expected auto, {', '.join(decode.MODES)}", 2)
    # dlm.generate fills masks: neither applies
    if args["dlm"] and (args["jsonl"] or args["decode"] != "auto"):
        flag = f"--jsonl={args['jsonl']}" if args["jsonl"] else f"--decode={args['decode']}"
        die(f"{flag} is for an autoregressive model; a masked-diffusion model (--dlm=True) prints "
            f"its samples, filled by lessons/dlm.py: drop {flag.split('=')[0]}", 2)
    if args["remasking"] not in ("random", "low_confidence"):
        die(f"--remasking={args['remasking']}: expected random or low_confidence", 2)
    if not 0 <= args["seed"] < 2**64:
        die(f"--seed={args['seed']}: expected an integer >= 0 and below 2**64", 2)
    if args["start"].startswith("FILE:"):  # nanoGPT's --start=FILE:prompt.txt
        path = args["start"][5:]
        try:
            with open(path, "rb") as f:
                args["start"] = f.read().decode("utf-8")
        except OSError as e:
            die(f"--start=FILE:{path}: cannot read the prompt file ({e.strerror or e})", 2)
        except UnicodeDecodeError as e:
            die(f"--start=FILE:{path}: not UTF-8 text (byte {e.start}); save the prompt as UTF-8", 2)
    try:
        args["start"].encode("utf-8")
    # an undecodable byte on the command line arrives as a lone surrogate
    except UnicodeEncodeError:
        die("--start: not valid UTF-8 text; pass the prompt in UTF-8", 2)
    device = args["device"]
    check_device(device)  # train.py's rule (tools/runtime.py)
    no_cuda = device.split(":")[0] == "cpu" or not torch.cuda.is_available()
    if args["decode"] in ("graph", "compile") and no_cuda:
        die(f"--decode={args['decode']} replays a CUDA graph: it needs a CUDA device "
            f"(--device={device}); use --decode=eager or fixed", 2)
    outputs.check_input("--ckpt", args["ckpt"])
    # before any checkpoint is read: nothing is sampled for a file that cannot be kept
    if args["jsonl"]:
        outputs.check_output("--jsonl", args["jsonl"], "text", overwrite=args["overwrite"],
                            inputs=[("--ckpt", args["ckpt"])], ckpt=args["ckpt"])


if __name__ == "__main__":
    main(sys.argv[1:])
