"""
Draw a training run's curves from its metrics.jsonl: train and val loss, lambda and the learning rate, the
gradient norm before and after clipping (clipped steps marked), to one PNG beside the log.

    python -m tools.plot out/stage2                  -> out/stage2/curves.png
    python -m tools.plot out/stage2 --out=run.png

The PNG names the metrics.jsonl it was drawn from (its Source text chunk): plotting the same run again replaces it;
any other PNG (another run's, a committed figure) is replaced only with --overwrite=True, and a file of another
kind never (tools/common.py check_output). The PNG is written whole or not at all (common.atomic_write).

matplotlib is needed here only (pip install -r requirements.txt has it); training never imports it.
Test: python -m pytest tests/test_plot.py
"""

import os
import sys
from dataclasses import dataclass

from tools import common, runtime
from tools.flags import die, parse


@dataclass
class PlotFlags:
    out: str = ""                # the PNG to write; "" = curves.png in the run directory
    overwrite: bool = False      # replace a PNG that is not this run's plot (another run's, a committed figure)


def read_metrics(run_dir):
    """(step records, evaluation records) of <run_dir>/metrics.jsonl; a torn last line (a killed run) is skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file; pass a run directory such as out/stage2")
    recs = runtime.read_metrics(path)
    steps = [r for r in recs if "val_loss" not in r and r.get("loss") is not None]
    evals = [r for r in recs if "val_loss" in r]
    if not steps:
        raise ValueError(f"{path}: no training steps logged yet")
    return steps, evals


def plot(run_dir, out, steps, evals):
    """Draw the run's step and evaluation records (read_metrics) into the PNG out. Returns the number of clipped
    steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [r["step"] for r in steps]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    a.plot(x, [r["loss"] for r in steps], lw=0.8, label="train loss")
    if evals:
        a.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val loss")
    a.set_ylabel("loss")
    a.legend()
    b.plot(x, [r["lambda"] for r in steps], label="lambda (0 fp, 1 ternary)")
    b.set_ylabel("lambda")
    b2 = b.twinx()
    b2.plot(x, [r["lr"] for r in steps], color="tab:orange", label="lr")
    b2.set_ylabel("lr")
    b.legend(loc="upper left")
    b2.legend(loc="lower right")
    c.plot(x, [r["raw_norm"] for r in steps], lw=0.8, label="grad norm")  # zclip.py's names (runtime.read_metrics)
    c.plot(x, [r["clipped_norm"] for r in steps], lw=0.8, label="after clipping")
    clipped = [r for r in steps if r.get("was_clipped")]
    c.plot([r["step"] for r in clipped], [r["raw_norm"] for r in clipped], "rx", label=f"clipped ({len(clipped)})")
    c.set_yscale("log")
    c.set_xlabel("step")
    c.legend()
    fig.suptitle(os.path.abspath(run_dir))
    fig.tight_layout()
    try:
        with common.atomic_write(out) as tmp:
            fig.savefig(tmp, dpi=100, format="png", metadata={common.PNG_SOURCE: _source(run_dir)})
    finally:
        plt.close(fig)
    return len(clipped)


def _source(run_dir):
    return os.path.abspath(os.path.join(run_dir, "metrics.jsonl"))


def main(argv):
    flags, dirs = parse(argv, PlotFlags, __doc__, positional="RUN_DIR  a run directory holding metrics.jsonl")
    if len(dirs) != 1:
        die("give one run directory, e.g. python -m tools.plot out/stage2", 2)
    out = flags.get("out") or os.path.join(dirs[0], "curves.png")
    if not out.endswith(".png"):
        die(f"--out={out}: expected a .png file name", 2)
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        die("plotting needs matplotlib: pip install -r requirements.txt (or pip install matplotlib)")
    try:
        steps, evals = read_metrics(dirs[0])
    except ValueError as e:
        die(str(e))
    common.check_output("--out", out, "png", _source(dirs[0]), flags.get("overwrite", False))
    try:
        with common.stoppable("--out", out):
            n_clip = plot(dirs[0], out, steps, evals)
    except OSError as e:
        die(f"--out={out}: cannot write it ({e.strerror or e}); the file there, if any, is unchanged; pass another --out")
    print(f"wrote {out}: {len(steps)} steps, {len(evals)} evaluations, {n_clip} clipped steps")


if __name__ == "__main__":
    main(sys.argv[1:])
