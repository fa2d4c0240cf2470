#!/usr/bin/env bash
# The GPU check: everything in this repository that needs a CUDA GPU, in one go, ending with one summary that
# names the device. Run it first on any machine with a GPU, and put its numbers in README with the device named.
#   bash lab/gpu_check.sh            (about 10 min on one H100; OUT=... moves the logs from out/gpu_check/)
# Steps (each one's full output goes to $OUT/<step>.log; a failing step does not stop the others):
#   kernels      the Triton kernel and packed-inference tests, compiled on CUDA (not the interpreter; dp4a itself)
#   bench        python -m lab.bench: ternary kernel vs bf16 F.linear at M = 1, 16, 2048
#   bench_train  python -m lab.bench --train: QAT vs bf16 step time, Muon's share, MFU
#   train        the CUDA preset, stage 2 from scratch for STEPS (default 300) steps, timed: tokens/s
# Exit status: 0 if every step passed, 1 if a step failed, 2 without a CUDA GPU (nothing is run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
PYTHON=${PYTHON:-python}  # the interpreter with this project's packages: PYTHON=/path/to/venv/bin/python bash ...
STEPS=${STEPS:-300}
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one" >&2
  exit 2
fi
mkdir -p "$OUT"
: > "$OUT/status"
step() {  # step NAME COMMAND...: run it, keep its output, record its exit status and wall time
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name ${PIPESTATUS[0]} $((SECONDS - t0))" >> "$OUT/status"
}
step kernels "$PYTHON" -m pytest -q -rA tests/test_kernels.py tests/test_packed.py
step bench "$PYTHON" -m lab.bench
step bench_train "$PYTHON" -m lab.bench --train
step train "$PYTHON" train.py --stage=2 --device=cuda --init_from=scratch --max_iters="$STEPS" \
  --eval_interval="$STEPS" --out_dir="$OUT/run" --overwrite=True
"$PYTHON" - "$OUT" <<'PY'
import json, os, statistics, sys, torch, triton
out = sys.argv[1]
print(f"\n==== GPU check: {torch.cuda.get_device_name(0)} (torch {torch.__version__}, triton {triton.__version__}, "
      f"CUDA {torch.version.cuda}) ====")
failed = 0
for line in open(os.path.join(out, "status")):
    name, rc, secs = line.split()
    failed += rc != "0"
    log = open(os.path.join(out, f"{name}.log")).read().splitlines()
    print(f"{name:12s} {'ok' if rc == '0' else f'FAILED (exit {rc})':16s} {secs:>5s} s   log: {out}/{name}.log")
    if name == "kernels":
        print("  " + next((l for l in reversed(log) if " passed" in l or " failed" in l), "(no pytest summary)"))
    elif name in ("bench", "bench_train"):
        print("\n".join("  " + l for l in log[-14:]))
    elif name == "train" and os.path.exists(os.path.join(out, "run", "stage2", "metrics.jsonl")):
        recs = [json.loads(l) for l in open(os.path.join(out, "run", "stage2", "metrics.jsonl"))]
        steps = [r for r in recs if "tok_per_s" in r]
        late = steps[len(steps) // 5:]  # past compilation and warm-up
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        if late:
            print(f"  CUDA preset, {steps[-1]['step']} steps: median {statistics.median(r['tok_per_s'] for r in late):,.0f} "
                  f"tokens/s, {statistics.median(r['ms'] for r in late):.0f} ms/step over steps "
                  f"{late[0]['step']}..{late[-1]['step']}; final val loss {val[-1] if val else float('nan'):.4f}")
sys.exit(1 if failed else 0)
PY
