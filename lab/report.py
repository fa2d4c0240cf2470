"""
The table's pages: lab/results/<table>.md (mean +- std over seeds, the "vs" and "gap closed"
columns, Table.pairs compared beneath), <table>.json (the summary and every run) and the plots
(<table>.png, _logits.png, _final.png).

Report is what Lab (lab/runner.py) inherits to write them: it reads self.table, self.root,
self.results and self.found(), the runs under root that count. A report never replaces a row's
committed runs with fewer. Statistics: mean and sample standard deviation (ddof=1) over seeds;
"differs" needs |delta| > 2 std of the noisier of the two rows.
Test: python -m pytest tests/test_lab.py
"""

import contextlib
import json
import os
import statistics
import tempfile

from lab.tables import LabError
from tools import atomic


class Report:
    """The pages of a Lab's table (see the module docstring for what it reads of the Lab)."""

    def summary(self, runs=None):
        """{row: {mean, std, n, values}} over the runs (default: those found under root)."""
        runs = self.found() if runs is None else runs
        out = {}
        for row in (r for r in self.table.rows if r.shown):
            rs = runs.get(row.name, [])
            out[row.name] = {"label": row.label, **_stats([r["val_loss"] for r in rs]),
                             "once": row.once}
            for name in self.table.extra_corpora:  # the other corpora's val loss of the same runs
                vals = [v for r in rs if (v := r.get("extra_val_loss", {}).get(name)) is not None]
                out[row.name][name] = {**_stats(vals), "once": row.once}
        return out

    def markdown(self, runs):
        summ = self.summary(runs)
        base = summ.get(self.table.baseline, {})
        ref = summ.get(self.table.reference, {})
        extra, measures = self.table.extra_corpora, self.table.measures
        n_seeds = max((s["n"] for s in summ.values()), default=0)
        lines = [f"| row | val loss, mean ± std ({n_seeds} seeds) | vs {self.table.baseline} | " +
                 "".join(f"{col} | vs {self.table.baseline} | " for col in extra.values()) +
                 "".join(f"{col} | " for col in measures.values()) +
                 (f"gap to {self.table.reference} closed |" if self.table.reference else ""),
                 "|---|---|---|" + "---|---|" * len(extra) + "---|" * len(measures) +
                 ("---|" if self.table.reference else "")]
        for name, s in summ.items():
            vals = {k: [r.get(k) for r in runs.get(name, [])] for k in measures}
            lines.append(
                f"| {s['label']} | {fmt(s, n_seeds)} | {versus(s, base)} | "
                + "".join(f"{fmt(s[c], n_seeds)} | {versus(s[c], base.get(c, {}))} | " for c in extra)
                + "".join(f"{_mean_of(vals[k])} | " for k in measures)
                + (f"{closed(s, base, ref)} |" if self.table.reference else "")
            )
        if self.table.pairs:
            lines += [
                "",
                "| comparison | val loss: difference | "
                + "".join(f"{c}: difference | " for c in extra.values()),
                "|---|---|" + "---|" * len(extra),
            ]
            lines += [
                f"| {a} vs {b} | {versus(summ[a], summ[b])} | "
                + "".join(f"{versus(summ[a][c], summ[b][c])} | " for c in extra)
                for a, b in self.table.pairs
            ]
        return "\n".join(lines)

    def report(self, log=print):
        """Markdown and JSON (and a PNG of the val curves, if matplotlib is there) under
        lab/results/. A row the committed <table>.json holds more runs of than this report finds (a
        fresh clone, fewer --seeds, another --root) keeps its committed runs; with no row to update,
        no file is written. Returns the summary."""
        stem = os.path.join(self.results, self.table.name)
        committed, found = _committed_runs(stem + ".json"), self.found()
        kept = [n for n, rs in found.items() if len(committed.get(n, ())) > len(rs)]
        runs = {n: committed[n] if n in kept else rs for n, rs in found.items()}
        print(self.markdown(found))
        # run or scored here
        new = any(not r.get("adopted") for n, rs in found.items() if n not in kept for r in rs)
        if kept:
            counts = ", ".join(
                f"{n} ({len(committed[n])} committed, {len(found[n])} found)" for n in kept
            )
            log(f"[lab] {self.table.name}: kept the runs of {counts} from {stem}.json (a report "
                f"never replaces runs with fewer); `python -m lab {self.table.name}` trains what "
                "is missing; " +
                ("the other rows are updated" if new else "nothing was written"))
        elif not new:
            log(f"[lab] {self.table.name}: no run finished under {self.root}" +
                (f" (every one found was taken from {stem}.json)" if any(found.values()) else "") +
                "; nothing was written")
        if new:
            self._write(stem, runs)
        return self.summary(runs)

    def _write(self, stem, runs):
        """The page, its JSON and plots, each written beside its old file (atomic.atomic_write), and
        all renamed over them together once every one is complete: a full disk or a read-only
        directory leaves the committed pages as they were."""
        name, written = self.table.name, []
        self.check_writable()

        # where to write results/<filename> now; it lands there when every file is written
        def place(filename):
            written.append(filename)
            return files.enter_context(atomic.atomic_write(os.path.join(self.results, filename)))
        try:
            with contextlib.ExitStack() as files:
                with open(place(name + ".md"), "w") as f:
                    f.write(f"# {name}: {self.table.about}\n\n" + "\n".join(self.table.notes) +
                            f"\n\nCommand: `python -m lab {name}`; val loss over the whole val "
                            "split of the shipped corpus. \"vs\": mean difference, and whether it "
                            "exceeds 2 std of the noisier of that row and "
                            f"{self.table.baseline}. {code_line(runs)}\n\n{self.markdown(runs)}\n")
                with open(place(name + ".json"), "w") as f:
                    json.dump(
                        {
                            "table": name,
                            "seeds": sorted({r["seed"] for rs in runs.values() for r in rs}),
                            "summary": self.summary(runs),
                            # as committed
                            "runs": [
                                {k: v for k, v in r.items() if k != "adopted"}
                                for row in self.table.rows
                                for r in runs[row.name]
                            ],
                        },
                        f,
                        indent=1,
                    )
                self.plot(place, runs)
        except OSError as e:  # a full disk: the new files go, the committed ones stay
            raise LabError(self._unwritable(e)) from None
        print(f"[lab] wrote {', '.join(sorted(written))} in {self.results}")

    def check_writable(self):
        try:
            os.makedirs(self.results, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".check-", dir=self.results))
        except OSError as e:
            raise LabError(self._unwritable(e)) from None

    def _unwritable(self, e):
        return (f"{self.results}: cannot write the table there ({e.strerror or e}: {e.filename}); "
                f"nothing was changed, the runs under {self.root} are kept; make it writable and "
                f"run: python -m lab {self.table.name} --report")

    def plot(self, place, runs):
        """The val curves (<table>.png), and where the table has them the max-logit curves
        (<table>_logits.png) and the final loss against the rows' numbers (<table>_final.png);
        place(name) says where to write each."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("[lab] matplotlib is not installed, so no curve plot (pip install "
                  "matplotlib); the table is written")
            return
        fig, ax = plt.subplots(figsize=(8, 5))
        for row in self.table.rows:
            curves = [r["curve"] for r in runs.get(row.name, [])]
            if not curves or row.name in self.table.no_curve:
                continue
            steps = [p[0] for p in curves[0]]
            mean = [
                statistics.mean(c[i][1] for c in curves if i < len(c)) for i in range(len(steps))
            ]
            ax.plot(steps, mean, marker="o", label=row.name)
        ax.set_xlabel(self.table.steps_label)
        ax.set_ylabel("val loss (sampled evals, mean over seeds)")
        ax.legend()
        fig.savefig(place(f"{self.table.name}.png"), dpi=100, format="png")
        plt.close(fig)
        self.plot_logits(place, plt, runs)
        summ = self.summary(runs)
        pts = [(x, summ[r]) for r,
               x in self.table.final_loss_x.items() if summ[r]["mean"] is not None]
        # final whole-val loss against a row's number (e.g. the switch point), with 1-std error bars
        if pts:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.errorbar([x for x, _ in pts], [s["mean"] for _, s in pts],
                        yerr=[s["std"] or 0 for _, s in pts], marker="o", capsize=4)
            ax.set_xlabel(self.table.final_loss_x_label)
            if self.table.final_loss_x_log:
                ax.set_xscale("log")
            ax.set_ylabel("final val loss, whole val split (mean ± std)")
            fig.tight_layout()
            fig.savefig(place(f"{self.table.name}_final.png"), dpi=100, format="png")
            plt.close(fig)

    def plot_logits(self, place, plt, runs):
        """The logged max attention logit against step, mean over seeds, for the table's
        logit_rows."""
        fig, ax, drawn = *plt.subplots(figsize=(8, 5)), 0
        for i, name in enumerate(self.table.logit_rows):
            curves = [r["logit_curve"] for r in runs.get(name, []) if r.get("logit_curve")]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot(
                    [p[0] for p in curves[0][:n]],
                    [statistics.mean(c[j][1] for c in curves) for j in range(n)],
                    # dashed: an identical curve shows
                    label=name,
                    linestyle="-" if i % 2 == 0 else "--",
                )
                drawn += 1
        if drawn:
            ax.set_xlabel(self.table.steps_label)
            ax.set_ylabel("max attention logit of the step (mean over seeds)")
            ax.legend()
            fig.savefig(place(f"{self.table.name}_logits.png"), dpi=100, format="png")
        plt.close(fig)


def code_line(runs):
    """The sentence naming the code the runs come from: the commits that trained them (each run's
    trained_at, else the commit that scored it), with how many runs each, and the runs that record none."""
    counts, unknown = {}, 0
    for rs in runs.values():
        for r in rs:
            commits = r.get("trained_at") or ([r["commit"]] if r.get("commit") else [])
            unknown += not commits
            for c in commits:
                counts[c] = counts.get(c, 0) + 1
    named = ", ".join(f"{c[:7]}{c[40:]} ({n} run{'s' * (n > 1)})" for c, n in counts.items())
    if not counts:
        return "Code: no run records its commit."
    return (f"Code: {'one commit' if len(counts) == 1 else f'{len(counts)} commits'}, {named}" +
            (f"; {unknown} run{'s record' if unknown > 1 else ' records'} none" if unknown else "") + ".")


def _stats(vals):
    return {"values": vals, "n": len(vals), "mean": statistics.mean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else None}


def _mean_of(vals):
    """mean ± std (ddof 1) over seeds, or the mean of one."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return ""
    return f"{statistics.mean(vals):,.4g}" + (
        f" ± {statistics.stdev(vals):,.2g}" if len(vals) > 1 else ""
    )


def fmt(s, seeds=None):
    """mean ± std; a row with fewer runs than the page's seeds says how many it has."""
    if s["mean"] is None:
        return "not run"
    if s.get("once"):
        return f"{s['mean']:.4f} (one run: no seed involved)"
    if s["std"] is None:
        return f"{s['mean']:.4f} (1 seed)"
    short = f" ({s['n']} of {seeds} seeds)" if seeds and s.get("n", seeds) < seeds else ""
    return f"{s['mean']:.4f} ± {s['std']:.4f}{short}"


MIN_SEEDS = 3  # runs a seeded row needs for a verdict


def versus(s, base):
    """Mean difference to the baseline row, and whether it is more than 2 std of the noisier of the
    two rows; no verdict from a row of fewer than MIN_SEEDS runs."""
    if s["mean"] is None or not base or base.get("mean") is None or s is base:
        return ""
    d = s["mean"] - base["mean"]
    if s.get("once") and base.get("once"):  # two runs that no seed changes: the difference is exact
        return f"{d:+.4f} ({'better' if d < 0 else 'worse'}, exact: no seed involved)"
    seeded = [x for x in (s, base) if not x.get("once")]
    if any(x.get("std") is None or x.get("n", MIN_SEEDS) < MIN_SEEDS for x in seeded):
        return f"{d:+.4f} (too few seeds for a verdict)"
    noise = 2 * max(x["std"] for x in seeded)
    verdict = ("better" if d < 0 else "worse") if abs(d) > noise else "no measurable difference"
    return f"{d:+.4f} ({verdict})"


def closed(s, base, ref):
    """Fraction of the baseline -> reference gap that this row closes (1 = reaches the
    reference)."""
    if (
        s["mean"] is None
        or not base
        or not ref
        or base.get("mean") is None
        or ref.get("mean") is None
    ):
        return ""
    gap = base["mean"] - ref["mean"]
    return (
        f"{(base['mean'] - s['mean']) / gap:.0%}"
        if gap > 0 and s is not ref and s is not base
        else ""
    )


def _committed_runs(path):
    """{row: [run, ...]} of a table's committed JSON; {} when there is none."""
    if not os.path.exists(path):
        return {}
    out = {}
    try:
        with open(path, errors="replace") as f:
            for r in json.load(f)["runs"]:
                if not isinstance(r["val_loss"], (int, float)):
                    raise TypeError(f"val_loss {r['val_loss']!r}")
                out.setdefault(r["row"], []).append(_current_keys(r))
    except (ValueError, KeyError, TypeError) as e:
        raise LabError(f"{path}: not a lab table ({type(e).__name__}: {e}); nothing was written; "
                       f"restore it (git checkout {path}) or move it away, then run the same "
                       "command again") from None
    return out


# a key that stored results (the committed tables' runs) may hold -> lab's name
OLD_KEYS = {"also": "extra_val_loss"}


def _current_keys(res):
    """A stored result (result.json, a committed table's run) with lab's key names."""
    return {OLD_KEYS.get(k, k): v for k, v in res.items()}
