#!/usr/bin/env bash
# The GPU check: everything in this repository that needs a CUDA GPU, in one go, inside one 6-minute window on one
# H100 (compiles included), ending with summary.json and a printed summary that names the device.
#   bash lab/gpu_check.sh            (GPU_CHECK_OUT=... moves everything from out/gpu_check/; STEPS=... the timed
#                                     run's steps; COPY_TO=<folder> also gets the results, 8 small files, at the end)
# Every step runs under its own `timeout` (a native hang kills only that step, which is then reported as "timeout")
# and writes its whole output to <out>/<step>.log; a failing step does not stop the others. The steps run in order
# of what they prove, each with a budget (below) plus whatever the steps before it left unused, and never more than
# is left of the whole window (WINDOW, 330 s): one that would get under 20 s is skipped and reported as such, so
# the script ends within 6 minutes whatever a step does.
#   kernels       tests/test_kernels.py, test_packed.py and gpu_decode.py compiled on CUDA (not the interpreter), on
#                 12 pytest-xdist workers sharing one TRITON_CACHE_DIR (each kernel config and shape JIT-compiles
#                 once, ~1-2 s), test by test (--dist load: pytest.ini's loadfile would give each file, and so all
#                 of test_kernels.py's compiles, one worker); not the slow ones (CPU-only: training runs and
#                 exports through sample.py --device=cpu, each worker's own copy)
#   bench         python -m lab.bench: the ternary kernel vs bf16 F.linear at M = 1, 16, 2048 (GPU
#                 time in one CUDA graph, do_bench's median, host us per call)
#   decode        python -m lab.bench --decode --modes=graph,compile,eager: batch-1 greedy decoding of
#                 the CUDA preset, fp bf16 and packed (tok/s, loop and replay us per token, kernels
#                 and syncs per token), the graphed rows (the targets) first
#   decode_1b     python -m lab.bench --decode --shape=1b: the same at a 1B-class shape (16 x 2048,
#                 GQA 32/8, vocab 128,256, random weights), eager and graphed, where the weights set
#                 a token's time
#   train         our train.py --stage=2 on the CUDA preset from scratch, STEPS (default 40) steps
#                 of 8 micro-batches of 8 x 1024 tokens: the median ms/step of the steps after the
#                 first fifth (compiling the preset, ~40-50 s, is in the first step, so excluded)
#   bench_train   python -m lab.bench --train --runs=nanogpt_c: the nanoGPT-shaped baseline
#                 (lab/nanogpt.py) at the same 8 x 8 x 1024 tokens a step, compiled, its compile
#                 in the warm-up steps; the summary prints our train step over it (target <= 1.25x)
# Exit status: 0 if every step passed, 1 if a step failed, timed out or was skipped, 2 without a CUDA GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-out/gpu_check}  # its own name: a lent machine's tooling may set OUT for what it sends back
COPY_TO=${COPY_TO:-}  # a folder for the results that fit a small return: summary.json, the step logs, the metrics
# the interpreter with this project's packages (PYTHON=/path/to/venv/bin/python bash ...): python, else python3
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
STEPS=${STEPS:-40}
WINDOW=${WINDOW:-330}  # seconds for all steps; the summary gets 20 more: 6 minutes with a kill-after
END=$((SECONDS + WINDOW))  # the probe below counts in the window
# a CUDA driver that hangs at its first call stops the probe, not the script
timeout --signal=TERM --kill-after=5 30 "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
probe=$?
if (( probe != 0 )); then
  if (( probe == 1 )); then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one" >&2
  else
    echo "gpu_check.sh: asking torch for a CUDA GPU failed (exit status $probe; 124: no answer in 30 s)" >&2
  fi
  exit 2
fi
mkdir -p "$OUT"
: > "$OUT/status"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton_cache}  # shared by the workers and the later steps
BANK=0  # seconds the steps so far left unused of their budgets: the next step may use them
step() {  # step NAME SECONDS COMMAND...: run it under min(SECONDS + BANK, what is left), keep its output and status
  local name=$1 limit=$(($2 + BANK)); shift 2
  local left=$((END - SECONDS))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "== $name: skipped (${left}s left of the ${WINDOW}s window)"
    echo "skipped" > "$OUT/$name.log"
    echo "$name skipped 0" >> "$OUT/status"
    return
  fi
  echo "== $name (at most ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? used=$((SECONDS - t0))
  tail -n 3 "$OUT/$name.log"
  echo "$name $rc $used" >> "$OUT/status"
  BANK=$(( used < limit ? limit - used : 0 ))
}
# budgets (seconds), adding up to the 330 s window; predictions, from issue 47's H100 run (kernel tests 96 s on
# fewer workers; the kernel table and --decode 100 s before the graph rows; ~40-50 s to compile the preset) and
# the work each step does now: kernels (12 workers test by test) -> 85; bench (~13 Triton compiles, 44 do_bench
# and 3 graphs a shape) -> 45; decode (two compiles of the preset's decode step) -> 70; decode_1b (no compile,
# the kernels cached) -> 25; train (~5 s start, 40-50 s compile, 39 steps of ~0.25 s, an evaluation, a 1.1 GB
# checkpoint) -> 70; bench_train (a nanoGPT-shape compile, 12 steps, 2 profiled) -> 35
step kernels 85 "$PYTHON" -m pytest -q -rA -p no:cacheprovider -n 12 --dist load -m "not slow" tests/test_kernels.py \
  tests/test_packed.py tests/gpu_decode.py
step bench 45 "$PYTHON" -m lab.bench
step decode 70 "$PYTHON" -m lab.bench --decode --modes=graph,compile,eager
step decode_1b 25 "$PYTHON" -m lab.bench --decode --shape=1b
step train 70 "$PYTHON" train.py --stage=2 --device=cuda --init_from=scratch --max_iters="$STEPS" \
  --eval_interval="$STEPS" --log_interval=1 --out_dir="$OUT/run" --overwrite=True
step bench_train 35 "$PYTHON" -m lab.bench --train --runs=nanogpt_c
timeout 20 "$PYTHON" - "$OUT" <<'PY'
import json, os, re, statistics, sys, torch, triton
out = sys.argv[1]
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA (a stand-in run)"
summary = dict(device=device, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, steps={})
print(f"\n==== GPU check: {device} (torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}) ====")
failed = 0
for line in open(os.path.join(out, "status")):
    name, rc, secs = line.split()
    failed += rc != "0"
    state = "ok" if rc == "0" else "skipped" if rc == "skipped" else "timeout" if rc in ("124", "137") else \
        f"failed (exit {rc})"
    log = open(os.path.join(out, f"{name}.log"), errors="replace").read().splitlines()
    entry = dict(state=state, exit=None if rc == "skipped" else int(rc), seconds=int(secs), log=f"{name}.log")
    print(f"{name:22s} {state:16s} {secs:>5s} s   log: {out}/{name}.log")
    if name == "kernels":
        entry["pytest"] = next((l for l in reversed(log) if " passed" in l or " failed" in l), "(no pytest summary)")
        print("  " + entry["pytest"])
    elif name in ("bench", "decode", "decode_1b", "bench_train"):
        entry["tail"] = log[-32:]  # the kernel table's rows, M = 1 included; decode's counted table and ratios
        print("\n".join("  " + l for l in entry["tail"]))
    elif name == "train" and os.path.exists(os.path.join(out, "run", "stage2", "metrics.jsonl")):
        recs = [json.loads(l) for l in open(os.path.join(out, "run", "stage2", "metrics.jsonl"))]
        steps = [r for r in recs if "tok_per_s" in r]
        late = steps[len(steps) // 5:]  # past compilation and warm-up
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        if late:
            entry.update(tok_per_s=statistics.median(r["tok_per_s"] for r in late),
                         ms_per_step=statistics.median(r["ms"] for r in late), steps=steps[-1]["step"],
                         final_val_loss=val[-1] if val else None)
            print(f"  CUDA preset, {entry['steps']} steps: median {entry['tok_per_s']:,.0f} tokens/s, "
                  f"{entry['ms_per_step']:.0f} ms/step over steps {late[0]['step']}..{late[-1]['step']}")
    summary["steps"][name] = entry
ours = summary["steps"].get("train", {}).get("ms_per_step")
base = os.path.join(out, "bench_train.log")
base = re.search(r"^nanoGPT baseline, compiled +[\d.]+M +([\d.]+)", open(base).read(), re.M) if \
    os.path.exists(base) else None
if ours and base:  # both 8 x 8 x 1024 tokens a step, compiled, their compiles excluded
    theirs = float(base[1])
    summary["train_vs_nanogpt"] = dict(ours_ms=ours, nanogpt_ms=theirs, ratio=ours / theirs,
                                       target=1.25)
    print(f"our train.py --stage=2 step / the nanoGPT-shaped step, 65,536 tokens each, compiled: "
          f"{ours:.1f} / {theirs:.1f} ms = {ours / theirs:.2f}x (target <= 1.25; ours the median of train.py's "
          "steps, its batch loading and log lines in them, the baseline the mean of 10 steps on batches "
          "already on the GPU)")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"summary: {out}/summary.json")
sys.exit(1 if failed else 0)
PY
rc=$?
if [ -n "$COPY_TO" ]; then  # 8 files: summary.json, the six step logs, the timed run's metrics
  mkdir -p "$COPY_TO" && cp "$OUT"/summary.json "$OUT"/*.log "$COPY_TO"/ 2>/dev/null
  cp "$OUT/run/stage2/metrics.jsonl" "$COPY_TO/train_metrics.jsonl" 2>/dev/null
  echo "copied to $COPY_TO: $(ls "$COPY_TO" | tr '\n' ' ')"
fi
exit $rc
