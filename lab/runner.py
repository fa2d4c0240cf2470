"""
The experiment runner, `python -m lab <table>`: every row of a table (lab/tables.py) for N seeds,
each run scored the same way, then the table (lab/report.py).

Rows may start from other rows' checkpoints (a teacher, a student), so each seed's runs go in order,
and the rows of seed k only ever read runs of seed k (the multi-teacher row also reads the next
seed's teacher). Every run is then scored the same way, whatever it logged itself (lab/score.py):
the loss of its final checkpoint over the WHOLE validation split of the shipped corpus (every window
of T+1 tokens once, no sampling), so all rows of a table compare the same tokens, and a row trained on
a mix of sources is still scored on the real text.

    python -m lab distill                  every row x 3 seeds, then lab/results/distill.md
    python -m lab distill --seeds=1        one seed of each row (a quick look; not for README)
    python -m lab distill --rows=teacher,student   only those rows (and what they need)
    python -m lab distill --report         no training: the table from the runs that exist
    python -m lab distill --rerun=True     train every run here, none taken from the committed table
    python -m lab list                     the tables and their rows

Runs go to out/lab/<table>/seed<k>/<row>/ (train.py's own out_dir layout). A run counts once its
checkpoint reaches the row's max_iters with the train.py flags the row has now: then it is scored
(result.json beside the checkpoint, with the commit that scored it and every commit whose code
trained it, runtime.git_commit: -dirty for uncommitted changes) and skipped next time; a stopped one
is resumed (--resume=True), so a long table can be finished over several sittings; a run made with
other flags than its row's now is trained again from the start, with a line saying which differ. On
another machine (no out/), a run the committed <table>.json holds with the same flags is taken from it (Lab.adopt),
unless --rerun=True: then every run is trained here, those taken earlier too (a run trained here
keeps its result: delete its directory under out/lab/<table>/ to train it again). SIGTERM or Ctrl-C
to lab goes on to the running train.py, which saves at the end of its step; lab then writes no table
and says to run the same command again. The table goes to lab/results/<table>.md and .json, and
lab/results/<table>.png (val curves) when matplotlib is installed (and <table>_logits.png, the max
attention logit per step, for tables that log it). A report never replaces a row's committed runs
with fewer (a fresh clone, --seeds=1, another --root): that row keeps them, and one line says so.
Test: python -m pytest tests/test_lab.py
"""

import contextlib
import io
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from lab import tables
from lab.report import Report, _committed_runs, _current_keys
from lab.score import dlm_val_loss, full_val_loss, ratios, state_bytes
from lab.tables import LabError, _shipped_dir
from tools import atomic, checkpoint, metrics, outputs, prepare, runtime
from tools.atomic import ROOT
from tools.flags import parse

SEEDS = (0, 1, 2)


class Stopped(LabError):
    """A run ended before its max_iters (a signal to lab, or to train.py): its checkpoint is kept
    for resume."""


# -----------------------------------------------------------------------------
# running


class Lab(Report):
    """A table's runs under root: what to run in which order (order), running and scoring them (run,
    run_one), taking finished ones from the committed table (adopt); the pages are Report's
    (lab/report.py)."""

    def __init__(self, table, seeds=SEEDS, root=None, results=None, python=sys.executable,
                 rerun=False):
        self.table, self.seeds, self.python = table, list(seeds), python
        # take no run from the committed table, and train again those taken before
        self.rerun = rerun
        self.root = root or os.path.join("out", "lab", table.name)
        self.results = results or os.path.join(ROOT, "lab", "results")  # where the table is written
        self.rows = {r.name: r for r in table.rows}
        self.shipped = os.path.join(ROOT, "data",
                                    f"shakespeare_{prepare.source_slug(table.tokenizer)}")
        # the train.py running now; the signals lab receives (run())
        self.child, self.signals = None, None
        self.log_start = 0  # where the running attempt's lines begin in its train.log (_train)
        self._max_iters = {}

    def seed_dir(self, seed):
        return os.path.join(self.root, f"seed{seed}")

    def run_dir(self, row, seed):
        return os.path.join(self.seed_dir(seed), row)

    def corpus_dir(self, name):
        """The shards of the shipped corpus `name` in the table's tokenizer (Table.extra_corpora),
        prepared if missing."""
        return _shipped_dir(name, self.table.tokenizer)

    def next_seed(self, seed):
        return self.seeds[(self.seeds.index(seed) + 1) % len(self.seeds)]

    def argv(self, row, seed, resume):
        flags = row.args.format(run=self.seed_dir(seed),
                                next_run=self.seed_dir(self.next_seed(seed)), seed=seed,
                                shipped=self.shipped).split()
        flags += [f"--seed={seed}", f"--out_dir={self.seed_dir(seed)}", f"--run_name={row.name}",
                  "--device=cpu", "--resume=True" if resume else "--overwrite=True"]
        return [self.python, os.path.join(ROOT, "train.py"), *flags]

    def max_iters(self, name):
        """The step a run of this row must reach to count: its flags' max_iters, train.py's defaults
        beneath."""
        if name not in self._max_iters:
            if self.rows[name].build is not None:
                return 0  # scored as built: no steps
            from tools.checks import build_config
            from tools.config import parse_args
            flags, err = self.argv(self.rows[name], self.seeds[0], resume=False)[2:], io.StringIO()
            try:
                with contextlib.redirect_stderr(err):  # train.py's one error line, for ours
                    self._max_iters[name] = build_config(parse_args(flags)).max_iters
            except SystemExit:
                raise LabError(f"row {name}: train.py refuses its flags: "
                               f"{err.getvalue().strip().removeprefix('error: ')}") from None
        return self._max_iters[name]

    def flags_now(self, name, seed):
        """The train.py flags this row's run of seed is made with now ([] for a row scored as built)."""
        return [] if self.rows[name].build is not None else _flags(self.argv(self.rows[name], seed, resume=False)[1:])

    def made_with(self, name, seed):
        """The train.py flags the run in its directory was made with: its result.json's, else those lab
        recorded when it started training it (argv.json); None when neither says."""
        d = self.run_dir(name, seed)
        for f in ("result.json", "argv.json"):
            try:
                with open(os.path.join(d, f)) as fh:
                    argv = json.load(fh)
                argv = argv.get("argv") if isinstance(argv, dict) else argv
                if isinstance(argv, list):
                    return _flags(argv)
            except (OSError, ValueError):
                continue
        return None

    def result(self, row, seed):
        """The run's result.json; None while it has none, when it scored a run stopped short of
        max_iters (an older lab did that after a preemption: that run is resumed, not counted), or
        when it was made with other train.py flags than the row's now (trained again, run_one)."""
        path = os.path.join(self.run_dir(row, seed), "result.json")
        if not os.path.exists(path):
            return None
        res = _read_result(path, row, seed)
        if res["steps"] < self.max_iters(row) or (self.rerun and res.get("adopted")):
            return None
        if _flags(res.get("argv") or [None]) != self.flags_now(row, seed):
            return None
        # scored before the start columns existed
        if "ratio_mask" in res and "ratio_mask_start" not in res:
            metrics = os.path.join(self.run_dir(row, seed), "metrics.jsonl")
            res.update(ratios([r for r in _records(metrics) if "ms" in r]))
        return res

    def order(self, wanted):
        """(row, seed) pairs to run: each seed's rows in table order, with what they need before
        them."""
        need = set()

        def add(name, seed):
            if (name, seed) in need:
                return
            row = self.rows[name]
            for dep in row.needs:
                add(dep, seed)
            for dep in row.needs_next:
                add(dep, self.next_seed(seed))
            need.add((name, seed))
        for seed in self.seeds:
            for name in wanted:
                if seed in self.row_seeds(name):
                    add(name, seed)
        names = [r.name for r in self.table.rows]
        # prerequisites (rows others need) of every seed first, so the cross-seed rows find them
        prereq = {d for r in self.table.rows for d in (*r.needs, *r.needs_next)}
        key = lambda p: (p[0] not in prereq, self.seeds.index(p[1]), names.index(p[0]))
        return sorted(need, key=key)

    def row_seeds(self, name):
        """The seeds a row runs: all, or the first alone for a row no seed changes."""
        return self.seeds[:1] if self.rows[name].once else self.seeds

    @property
    def stop(self):
        """The name of the first SIGTERM or SIGINT lab received in run(), else None."""
        return self.signals.requested if self.signals else None

    def run(self, wanted, log=print):
        """Train and score every (row, seed) that has no result yet. A SIGTERM or SIGINT (Ctrl-C)
        meanwhile is passed on to the train.py that is running, which saves at the end of its step;
        then Stopped is raised and nothing more is trained or scored. A second signal of the kind
        while lab scores stops it at once (atomic.Interrupted; a result.json is written whole or not
        at all)."""
        with atomic.StopSignal(forward=self._pass_on) as self.signals:
            todo = list(self.order(wanted))
            if not self.rerun:
                self.adopt(todo, log)
            left = [(n, s) for n, s in todo if self.result(n, s) is None]
            t0, ran = time.time(), 0
            for i, (name, seed) in enumerate(todo, 1):
                if self.stop:
                    raise Stopped(f"{self.stop}: stopped before {name} seed {seed}")
                if self.result(name, seed) is not None:
                    log(f"[lab] run {i} of {len(todo)}: {name} seed {seed}: done, skipped")
                    continue
                eta = (
                    f", about {(time.time() - t0) / ran * (len(left) - ran) / 60:.0f} min left"
                    if ran
                    else ""
                )
                log(f"[lab] run {i} of {len(todo)} ({len(left) - ran} to train{eta}): {name} seed "
                    f"{seed}")
                self.run_one(self.rows[name], seed, log)
                ran += 1

    def adopt(self, todo, log=print):
        """Take from the committed <table>.json each (row, seed) of todo it holds with this run's
        exact train.py flags and that has no result under root (a fresh machine has no out/): a
        finished run is never trained again in another sitting. Not while a row that starts from its
        checkpoint still has to run (the checkpoint is not committed). Its result.json is written
        under root, marked "adopted". Returns the pairs adopted."""
        committed = {(r["row"], r.get("seed")): r for rs in _committed_runs(
            os.path.join(self.results, self.table.name + ".json")).values() for r in rs}
        done, adopted = {p for p in todo if self.result(*p) is not None}, []
        for name, seed in reversed(todo):  # the rows that start from a run are decided before it
            res = committed.get((name, seed))
            # "0" for 0
            if res is None and (name, seed) not in done and (name, str(seed)) in committed:
                log(f"[lab] {name} seed {seed}: its run in {self.table.name}.json is not taken "
                    f"(its seed is {str(seed)!r}, a string, not the integer {seed}); it is trained "
                    "again")
            if res is not None and (name, seed) not in done and (why := _not_adoptable(res)):
                log(f"[lab] {name} seed {seed}: its run in {self.table.name}.json is not taken "
                    f"({why}); it is trained again")
                res = None
            users = [
                (r.name, s)
                for r in self.table.rows
                for s in self.seeds
                if (name in r.needs and s == seed)
                or (name in r.needs_next and self.next_seed(s) == seed)
            ]
            now = self.flags_now(name, seed)
            if res is not None and (name, seed) not in done and _flags(res["argv"]) != now:
                log(f"[lab] {name} seed {seed}: its run in {self.table.name}.json is not taken (its train.py "
                    f"flags differ from the row's now: {_flag_difference(_flags(res['argv']), now)}); it is "
                    "trained again")
                res = None
            if (
                (name, seed) in done
                or res is None
                or res["steps"] < self.max_iters(name)
                or any(u in todo and u not in done for u in users)
            ):
                continue
            os.makedirs(self.run_dir(name, seed), exist_ok=True)
            _write_json(os.path.join(self.run_dir(name, seed), "result.json"),
                        {**res, "adopted": True})
            done.add((name, seed))
            adopted.append((name, seed))
            log(f"[lab] {name} seed {seed}: finished in an earlier sitting, its result taken from "
                f"{self.table.name}.json (not trained again)")
        return adopted

    def _pass_on(self, signum):
        """A signal to lab goes on to the train.py running now, if any, which finishes its step and
        saves (a second signal of the kind stops it at once). Returns whether there was one."""
        if self.child is None:
            return False
        self.child.send_signal(signum)
        return True

    def run_one(self, row, seed, log=print):
        """Train the run to the row's max_iters (resuming its checkpoint if it has one), then score
        it."""
        d = self.run_dir(row.name, seed)
        os.makedirs(d, exist_ok=True)
        if row.build is not None:
            return self.score_built(row, seed, d, log)
        was, now = self.made_with(row.name, seed), self.flags_now(row.name, seed)
        fresh = was is not None and was != now  # its row's flags changed: the run starts over
        if fresh:
            log(f"[lab] {row.name} seed {seed}: the run in {d} was made with other flags "
                f"({_flag_difference(was, now)}); trained again from the start")
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(d, "result.json"))
        step, t0, commit = None if fresh else _saved_step(d), time.time(), _commit()
        # the earlier run's id: a checkpoint still of that run after training is none of the new run's
        old_run = outputs.checkpoint_run(os.path.join(d, checkpoint.LATEST)) if fresh else None
        cmd = self.argv(row, seed, resume=step is not None)
        if step is None or step < self.max_iters(row.name):
            if row.prepare is not None:
                row.prepare(self, seed)
            if metrics.drop_torn_line(os.path.join(d, "metrics.jsonl")):
                log(f"[lab] {row.name} seed {seed}: cut the torn last line off {d}/metrics.jsonl "
                    f"before resuming")
            log(f"[lab] {row.name} seed {seed}: {' '.join(cmd[1:])}")
            _write_json(os.path.join(d, "argv.json"), cmd[1:])  # what its checkpoints are made with
            code, step, where = self._train(cmd, d), _saved_step(d), f"{row.name} seed {seed}"
            if fresh and step is not None and outputs.checkpoint_run(os.path.join(d, checkpoint.LATEST)) == old_run:
                step = None
            if code != 0 and not self.stop:
                raise LabError(f"{where} failed (exit {code}): "
                               f"{_last_line(os.path.join(d, 'train.log'), self.log_start)} (its log: "
                               f"{d}/train.log)")
            want = self.max_iters(row.name)
            if self.stop:
                raise Stopped(f"{self.stop}: {where} stopped (train.py exit {code}); " +
                              (f"its checkpoint is at step {step} of {want}" if step is not None
                               else "it had saved no checkpoint yet"))
            if step is None or step < want:
                raise Stopped(f"{where}: train.py ended without an error at step {step} of {want} "
                              "(was it sent SIGTERM?); its checkpoint is kept and nothing was "
                              "scored")
        recs = _records(os.path.join(d, "metrics.jsonl"))
        steps = [r for r in recs if "ms" in r]
        extra = {}
        # the masked-token val loss at each t; val_loss = their mean
        if self.table.dlm_t and row.shown:
            scored = {t: dlm_val_loss(os.path.join(d, row.score), self.shipped,
                                      t) for t in self.table.dlm_t}
            extra = {f"masked_val_t{t}": v[0] for t, v in scored.items()}
            loss, n = statistics.mean(extra.values()), sum(v[1] for v in scored.values())
            # zclip.py's names
            extra.update(clipped_frac=statistics.mean(r["was_clipped"] for r in steps),
                         spikes=sum(r["z_score"] > 2.5 for r in steps), **ratios(steps))
        else:
            loss, n = full_val_loss(os.path.join(d, row.score), self.shipped)
        extra_val_loss = {name: full_val_loss(os.path.join(d, row.score), self.corpus_dir(name))[0]
                          for name in self.table.extra_corpora}
        opt = checkpoint.load(os.path.join(d, checkpoint.LATEST))["optimizer"]
        # every commit whose code trained it (each train.py process's first record names its own)
        trained = list(dict.fromkeys(r["commit"] for r in recs if "commit" in r))
        res = {**extra, "row": row.name, "seed": seed, "val_loss": loss, "val_tokens": n,
               "scored": row.score, "argv": cmd[1:], "commit": commit, "trained_at": trained,
               "extra_val_loss": extra_val_loss, "steps": step,
               "ms_per_step_median": statistics.median(r["ms"] for r in steps) if steps else None,
               "max_logit": max((r["max_logit"] for r in steps if "max_logit" in r), default=None),
               "optimizer_bytes": state_bytes(opt), "wall_s": time.time() - t0,
               "curve": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r],
               "logit_curve": [[r["step"], r["max_logit"]] for r in steps if "max_logit" in r]}
        _write_json(os.path.join(d, "result.json"), res)
        log(f"[lab] {row.name} seed {seed}: whole-val loss {loss:.4f} ({n} tokens), "
            f"{res['wall_s']:.0f} s")

    def score_built(self, row, seed, d, log=print):
        """A row with no training: the model row.build(lab) makes, scored as every run is (the whole
        val split)."""
        t0, commit = time.time(), _commit()
        model = row.build(self)
        # no run has made its shards yet
        if not os.path.exists(os.path.join(self.shipped, "meta.json")):
            _shipped_dir("shakespeare", self.table.tokenizer)
        try:
            loss, n = metrics.whole_val_loss(model, self.shipped, 16, "cpu")
            extra_val_loss = {
                name: metrics.whole_val_loss(model, self.corpus_dir(name), 16, "cpu")[0]
                for name in self.table.extra_corpora
            }
        except ValueError as e:
            raise LabError(str(e)) from None
        res = {"row": row.name, "seed": seed, "val_loss": loss, "val_tokens": n,
               "scored": "as built, no training", "argv": [], "commit": commit,
               "extra_val_loss": extra_val_loss, "steps": 0, "wall_s": time.time() - t0,
               "curve": []}
        _write_json(os.path.join(d, "result.json"), res)
        log(f"[lab] {row.name}: whole-val loss {loss:.4f} ({n} tokens), {res['wall_s']:.0f} s")

    def _train(self, cmd, d):
        """train.py in a process group of its own: a Ctrl-C in the terminal reaches lab only, which
        passes it on once (twice would stop train.py without a checkpoint). On Linux it is sent
        SIGTERM (it saves at the end of its step) if lab dies (SIGKILL, a closed terminal), so no
        train.py outlives lab to hold the run's lock. Returns its exit code; self.log_start is where
        this attempt's lines begin in train.log."""
        log = os.path.join(d, "train.log")
        self.log_start = os.path.getsize(log) if os.path.exists(log) else 0
        with open(log, "a") as f:
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                          process_group=0, preexec_fn=_with_parent(os.getpid()))
        try:
            if self.stop:  # the signal came between the last check and the start
                self.child.send_signal(signal.Signals[self.stop])
            return self.child.wait()
        finally:
            self.child = None

    def found(self):
        """{row: [result, ...]} of the runs under root that count (the runs Report's pages are made
        of)."""
        return {
            r.name: [
                res for s in self.row_seeds(r.name) if (res := self.result(r.name, s)) is not None
            ]
            for r in self.table.rows
        }


def _flags(argv):
    """train.py's flags of a recorded command (train.py's path, then its flags), without --resume and --overwrite
    (a run's first command and its resumptions differ only there)."""
    return [a for a in argv[1:] if not a.startswith(("--resume=", "--overwrite="))]


def _flag_difference(was, now):
    """The first flags that differ between two train.py argument lists, as one phrase."""
    gone, new = [a for a in was if a not in now], [a for a in now if a not in was]
    parts = ([f"it had {' '.join(gone[:2])}{' ...' * (len(gone) > 2)}"] if gone else []) + \
        ([f"the row has {' '.join(new[:2])}{' ...' * (len(new) > 2)}"] if new else [])
    return "; ".join(parts) or "the same flags in another order"


def _not_adoptable(res):
    """Why a committed run cannot be taken as finished (a finite val_loss, an integer steps and the
    list of train.py arguments it ran with are needed), or "" when it can."""
    if not math.isfinite(res["val_loss"]):
        return f"its val_loss is {res['val_loss']}"
    if not isinstance(res.get("steps"), int) or isinstance(res["steps"], bool):
        return f"steps {res.get('steps')!r} is not a step count"
    if not isinstance(res.get("argv"), list) or not all(isinstance(a, str) for a in res["argv"]):
        return "it records no argv, the train.py arguments it ran with" if "argv" not in res else \
            f"argv {res['argv']!r} is not the list of train.py arguments it ran with"
    return ""


def _read_result(path, row, seed):
    """A run's result.json, checked to be lab's JSON object for this row and seed."""
    fix = "move it away and lab scores the run again from its checkpoint"
    try:
        with open(path, errors="replace") as f:
            res = json.load(f)
    except ValueError as e:
        raise LabError(f"{path}: not JSON ({e}); {fix}") from None
    shape = {"row": str, "seed": int, "val_loss": (int, float), "steps": int, "curve": list}
    if (not isinstance(res, dict) or any(not isinstance(res.get(k), t) for k, t in shape.items())
            or (res["row"], res["seed"]) != (row, seed)):
        raise LabError(f"{path}: not lab's result of {row} seed {seed} (expected a JSON object "
                       f"with {', '.join(shape)}); {fix}")
    return _current_keys(res)


def _commit():
    """The commit of the checkout lab runs from (runtime.git_commit: -dirty when a tracked file
    differs from it; "unknown" outside a git checkout or without git)."""
    return runtime.git_commit(ROOT)


def _records(path):
    """The records of a run's metrics.jsonl (runtime.read_metrics), a corrupt line as a LabError."""
    try:
        return runtime.read_metrics(path)
    except ValueError as e:
        raise LabError(f"{e}, then run the same command again") from None


def _saved_step(d):
    """The step of the run's latest checkpoint; None before its first."""
    path = os.path.join(d, checkpoint.LATEST)
    if not os.path.exists(path):
        return None
    try:
        return checkpoint.load(path, ("step",))["step"]
    except checkpoint.CheckpointError as e:
        raise LabError(str(e)) from None


def _last_line(path, start=0):
    """The line that says why train.py stopped, of those written from byte `start` on (this attempt's): its last
    `error: ...` line without the prefix, else its last line (another process's lines may follow it)."""
    with open(path, "rb") as f:
        f.seek(start)
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or ["(an empty log)"])[-1].removeprefix("error: ")


def _with_parent(parent):
    """A preexec_fn for a child that gets SIGTERM when its parent (pid parent) dies: Linux's
    PR_SET_PDEATHSIG; elsewhere None (nothing is set up)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child

    def set_up():
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before it was set
            os.kill(os.getpid(), signal.SIGTERM)
    return set_up


def _write_json(path, obj):
    with atomic.written(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)


@dataclass
class LabFlags:
    seeds: int = len(SEEDS)      # seeds per row (0, 1, ...); a table's verdicts need 3
    rows: str = ""               # comma-separated rows to run; "" = every row of the table
    report: bool = False         # no training: write the table from the runs that exist
    root: str = ""               # where the runs live; "" = out/lab/<table>
    rerun: bool = False          # train every run here: none taken from the committed <table>.json


def dataset_around(path):
    """The prepared shard directory (one holding a meta.json) that path is, or is inside; else None."""
    d = os.path.realpath(path)
    while True:
        if os.path.isfile(os.path.join(d, "meta.json")):
            return d
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def main(argv):
    flags, names = parse(argv, LabFlags, __doc__,
                         positional="TABLE  one of: list, " + ", ".join(tables.TABLES))
    args = LabFlags(**flags)
    if not names or names[0] == "list":
        for name, make in tables.TABLES.items():
            t = make()
            print(f"{name}: {t.about}")
            for r in t.rows:
                print(f"  {r.name:14s} {r.label}")
        return 0
    if len(names) > 1 or names[0] not in tables.TABLES:
        print(f"error: unknown table {' '.join(names)!r}; tables: {', '.join(tables.TABLES)} "
              f"(python -m lab list)", file=sys.stderr)
        return 2
    table = tables.TABLES[names[0]]()
    if args.seeds < 1:
        print(f"error: --seeds={args.seeds}: expected an integer >= 1", file=sys.stderr)
        return 2
    inside = dataset_around(args.root) if args.root else None
    if inside:  # its runs' logs and checkpoints would land among the shards (train.py refuses only later)
        print(f"error: --root={args.root} is inside the prepared dataset {inside} (its meta.json): the runs would "
              "write into it; pass another --root (default out/lab/<table>)", file=sys.stderr)
        return 2
    lab = Lab(table, seeds=range(args.seeds), root=args.root or None, rerun=args.rerun)
    wanted = args.rows.split(",") if args.rows else [r.name for r in table.rows]
    bad = [w for w in wanted if w not in lab.rows]
    if bad:
        print(
            f"error: unknown row(s) {', '.join(bad)}; rows of {table.name}: {', '.join(lab.rows)}",
            file=sys.stderr,
        )
        return 2
    again = "python -m lab " + shlex.join(argv)
    try:
        if not args.report:
            lab.check_writable()  # before hours of training, not after
            t0 = time.time()
            lab.run(wanted)
            print(f"[lab] {table.name}: ran in {(time.time() - t0) / 60:.1f} min")
        lab.report()
    # every checkpoint and result.json so far is kept
    except (Stopped, KeyboardInterrupt, atomic.Interrupted) as e:
        why = (
            e
            if isinstance(e, Stopped)
            else (
                "interrupted (Ctrl-C)"
                if isinstance(e, KeyboardInterrupt)
                else f"interrupted (a second {signal.Signals(e.signum).name})"
            )
        )
        print(f"error: {why}; nothing was written to {lab.results}; to resume, run the same "
              f"command again: {again}", file=sys.stderr)
        return 1
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # a run directory that cannot be made, a disk that filled up: the table is not written
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror or e}; the table was not written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
