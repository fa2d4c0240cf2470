"""
Draw a training run's curves from its metrics.jsonl: train and val loss, lambda and the learning rate, the
gradient norm before and after clipping (clipped steps marked), to one PNG beside the log.

    python -m tools.plot out/stage2                  -> out/stage2/curves.png
    python -m tools.plot out/stage2 --out=run.png
    python -m tools.plot out/stage2/metrics.jsonl    (the log itself: the same)

The PNG names the metrics.jsonl it was drawn from (its Source text chunk): plotting the same run again replaces it;
any other PNG (another run's, a committed figure) is replaced only with --overwrite=True, and a file of another
kind never (tools/outputs.py check_output). The PNG is written whole or not at all (atomic.atomic_write).
Each curve is drawn from the records that hold it: a series the log lacks is left out with a note naming it;
the steps skipped as non-finite (no loss, no update) are marked on the loss panel and counted in the last line.

matplotlib is needed here only (pip install -r requirements.txt has it); training never imports it.
Test: python -m pytest tests/test_plot.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import math
import os
import sys
from dataclasses import dataclass

from tools import atomic, outputs, runtime
from tools.flags import die, parse


@dataclass
class PlotFlags:
    out: str = ""                # the PNG to write; "" = curves.png in the run directory
    overwrite: bool = False      # replace a PNG that is not this run's plot (another run's, a committed figure)


def read_metrics(run_dir):
    """(step records, evaluation records) of <run_dir>/metrics.jsonl; a torn last line (a killed run) is skipped.
    The step records include the steps skipped as non-finite (skipped(): "skipped": 1 and no loss). A file that
    cannot be read, or is not text, raises ValueError naming it (never blamed on --out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file; pass a run directory such as out/stage2")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not train.py's log; pass a run directory such as out/stage2 "
                         f"(metrics.jsonl is a file in it)")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        if b"\0" in head or not _utf8(head):
            raise ValueError(f"{path} is binary data, not train.py's log (JSON lines); pass a run directory such as "
                             f"out/stage2")
        recs = runtime.read_metrics(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e}); check its permissions, or pass another run "
                         f"directory") from None
    steps = [r for r in recs if "val_loss" not in r and "step" in r]
    evals = [r for r in recs if "val_loss" in r]
    if not steps:
        raise ValueError(f"{path}: no training steps logged yet")
    if all(map(skipped, steps)):
        raise ValueError(f"{path}: all {len(steps)} logged steps were skipped as non-finite, so there is no loss to "
                         f"draw; see the run's log")
    return steps, evals


def _utf8(head):
    import codecs
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at 4096 bytes is fine
        return True
    except UnicodeDecodeError:
        return False


def skipped(r):
    """A step record of a step skipped as non-finite (train.py logs "skipped": 1 and "loss": null)."""
    return bool(r.get("skipped")) or not _number(r.get("loss"))


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(recs, key, notes, path, what):
    """(steps, values) of the records holding a finite number under key; a note when some or all lack it."""
    pts = [(r["step"], r[key]) for r in recs if _number(r.get(key)) and _number(r.get("step"))]
    if len(pts) < len(recs):
        which = f"{len(recs) - len(pts)} of its {len(recs)}" if pts else "any of its"
        notes.append(f"note: {path}: no {key} in {which} step records; the {what} curve is "
                     f"{'drawn where it is' if pts else 'left out'}")
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(run_dir, out, steps, evals):
    """Draw the run's step and evaluation records (read_metrics) into the PNG out: each series from the records
    that hold it (a series missing from a record leaves a gap; missing from all, it is left out with a note),
    the steps skipped as non-finite marked on the loss panel. Returns (clipped steps, skipped steps, notes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = _source(run_dir)
    notes, done = [], [r for r in steps if not skipped(r)]
    bad = [r["step"] for r in steps if skipped(r) and _number(r.get("step"))]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    a.plot(*_series(done, "loss", notes, path, "train loss"), lw=0.8, label="train loss")
    if evals:
        a.plot(*_series(evals, "val_loss", [], path, "val loss"), "o-", label="val loss")
    if bad:  # the skipped steps (no loss, no update): a faint red line each across the loss panel
        a.vlines(bad, 0, 1, transform=a.get_xaxis_transform(), colors="red", lw=1, alpha=0.4,
                 label=f"skipped, non-finite ({len(bad)})")
    a.set_ylabel("loss")
    a.legend()
    lam = _series(steps, "lambda", notes, path, "lambda")  # skipped steps log their lambda too
    lr = _series(done, "lr", notes, path, "learning rate")
    b.plot(*lam, label="lambda (0 fp, 1 ternary)")
    b.set_ylabel("lambda")
    b2 = b.twinx()
    b2.plot(*lr, color="tab:orange", label="lr")
    b2.set_ylabel("lr")
    for ax, loc, xs in ((b, "upper left", lam[0]), (b2, "lower right", lr[0])):
        if xs:
            ax.legend(loc=loc)
    raw = _series(done, "raw_norm", notes, path, "grad norm")  # zclip.py's names (runtime.read_metrics)
    c.plot(*raw, lw=0.8, label="grad norm")
    c.plot(*_series(done, "clipped_norm", notes, path, "clipped grad norm"), lw=0.8, label="after clipping")
    clipped = [r for r in done if r.get("was_clipped")]
    c.plot([r["step"] for r in clipped if _number(r.get("raw_norm"))],
           [r["raw_norm"] for r in clipped if _number(r.get("raw_norm"))], "rx", label=f"clipped ({len(clipped)})")
    if any(v > 0 for v in raw[1]):
        c.set_yscale("log")
    c.set_xlabel("step")
    if raw[0] or clipped:
        c.legend()
    fig.suptitle(os.path.abspath(run_dir))
    fig.tight_layout()
    try:
        with atomic.atomic_write(out) as tmp:
            fig.savefig(tmp, dpi=100, format="png", metadata={outputs.PNG_SOURCE: path})
    finally:
        plt.close(fig)
    return len(clipped), len(bad), notes


def _source(run_dir):
    return os.path.abspath(os.path.join(run_dir, "metrics.jsonl"))


def main(argv):
    flags, dirs = parse(argv, PlotFlags, __doc__, positional="RUN_DIR  a run directory holding metrics.jsonl")
    if len(dirs) != 1:
        die("give one run directory, e.g. python -m tools.plot out/stage2", 2)
    if os.path.basename(dirs[0]) == "metrics.jsonl" and os.path.isfile(dirs[0]):  # the log itself: its run
        dirs[0] = os.path.dirname(dirs[0]) or "."
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
    outputs.check_output("--out", out, "png", _source(dirs[0]), flags.get("overwrite", False))
    try:
        with atomic.stoppable("--out", out):
            n_clip, n_bad, notes = plot(dirs[0], out, steps, evals)
    except OSError as e:
        die(f"--out={out}: cannot write it ({e.strerror or e}); the file there, if any, is unchanged; pass another --out")
    for note in notes:
        print(note)
    bad = f" ({n_bad} more skipped as non-finite, marked in red)" if n_bad else ""
    print(f"wrote {out}: {len(steps) - n_bad} steps{bad}, {len(evals)} evaluations, {n_clip} clipped steps")


if __name__ == "__main__":
    main(sys.argv[1:])
