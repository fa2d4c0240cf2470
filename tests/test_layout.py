"""The repository as a learner opens it: the lessons at the root, each concept file passing the first-screen test
(docstring about 30 lines, the algorithm within the first 50), and importing only what it may.
Run: python -m pytest tests/test_layout.py"""

import ast
import os

from conftest import ROOT

CONCEPTS = ["quant.py", "model.py", "muon.py", "zclip.py", "distill.py", "data.py", "tokenizer.py"]
LESSONS = {"lessons/dlm.py": "model", "lessons/muon_variants.py": "muon", "lessons/averaging.py": None, "lessons/subln.py": None,
           "lessons/clean.py": None}  # an extra lesson imports at most the core file it builds on
ALLOWED = {"torch", "numpy", "tiktoken", "triton"}
LAZY = {"transformers"}  # only inside a function (a model's tokenizer), as nanoGPT's model.py



def _tree(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read())


def _imports(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_root_shows_the_lessons():
    """What the repository holds at its root (git's files: a user's own outputs, out_smol/ say, are not ours)."""
    import subprocess
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    top = {p.split("/")[0] for p in tracked} or set(os.listdir(ROOT))  # not a git checkout: what is there
    py = sorted(f for f in top if f.endswith(".py"))
    assert py == sorted(CONCEPTS + ["train.py", "sample.py"])
    folders = {d for d in top if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith((".", "_"))}
    assert folders - {"data", "docs", "kernels", "tests"} == {"lessons", "tools", "lab"}


def test_each_lesson_passes_the_first_screen_test():
    for path in CONCEPTS + list(LESSONS):
        tree = _tree(path)
        doc = ast.get_docstring(tree, clean=False)
        assert doc and doc.count("\n") <= 32, (path, doc.count("\n"))
        first_def = min(n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        assert first_def <= 50, (path, first_def)
        assert "Test:" in doc or "Run:" in doc or "test" in doc.lower(), path  # says how to run or test it


def test_concept_files_import_only_the_standard_library_and_their_core_file():
    import sys
    stdlib = set(sys.stdlib_module_names)
    for path in CONCEPTS:
        tree = _tree(path)
        extra = _imports(tree) - stdlib - ALLOWED - LAZY - ({"quant"} if path == "model.py" else set())
        top = _imports(ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                                  type_ignores=[]))
        assert not extra and not top & LAZY, (path, extra, top & LAZY)
    for path, core in LESSONS.items():
        extra = _imports(_tree(path)) - stdlib - ALLOWED - ({core} if core else set())
        assert not extra, (path, extra)


# ----------------------------------------------------------------------------- the step reads where README says


STEP_FILES = {"train.py", "model.py", "quant.py", "muon.py", "zclip.py", "data.py"}  # README's "Reading order"


def _files_a_step_runs(run, step):
    """The repository files whose Python functions run during train.step(run, step), traced (sys.setprofile)."""
    import sys
    import train
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)
    sys.setprofile(profile)
    try:
        train.train_step(run, step, False)
    finally:
        sys.setprofile(None)
    root = os.path.realpath(ROOT) + os.sep
    return {os.path.relpath(f, root) for f in map(os.path.realpath, seen) if f.startswith(root) and os.path.isfile(f)}


def test_a_training_step_runs_only_train_py_and_the_concept_files(tmp_path):
    """One stage-2 step and one stage-3 step, traced: every repository function they run is in train.py or a
    concept file (stage 3 adds distill.py), none in tools/ or lessons/; and they do reach the files README names,
    so the trace itself is working."""
    import train
    from conftest import TINY
    for stage in (1, 2):  # the teacher and the student stage 3 starts from
        made = train.setup([f"--stage={stage}", *TINY, "--max_iters=1", f"--out_dir={tmp_path}"])
        try:
            train.training_loop(made)
        finally:
            made.unlock()
    for stage, want in ((2, STEP_FILES), (3, STEP_FILES | {"distill.py"})):
        run = train.setup([f"--stage={stage}", *TINY, "--max_iters=4", f"--out_dir={tmp_path}", f"--run_name=s{stage}",
                           f"--init_from={tmp_path / f'stage{stage - 1}' / 'ckpt.pt'}"])
        try:
            files = _files_a_step_runs(run, 0) | _files_a_step_runs(run, 1)
        finally:
            run.unlock()
        assert files == want, (stage, sorted(files))


def test_train_py_and_the_concept_files_import_no_lesson():
    """Lessons plug in from outside (tools/seams.py fills train.py's seams): the core never imports them."""
    for path in CONCEPTS + ["train.py"]:
        assert "lessons" not in _imports(_tree(path)), path
    assert "lessons" in _imports(_tree("tools/seams.py"))  # where they do come in


def test_every_entry_points_ctrl_c_preamble_is_one_call_in_code_not_docstring():
    """Each command's first statement after its docstring is the one call stop_on_ctrl_c(__name__) (tools/flags.py),
    which restores Ctrl-C's default while the imports load: code of the module, never text inside its docstring,
    and nowhere the pasted `signal.signal(...)` lines it replaces."""
    import glob
    import signal
    from tools.flags import stop_on_ctrl_c
    found = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)):
        if "/tests/" in path or path.endswith("tools/flags.py"):
            continue
        src = open(path).read()
        assert "signal.SIGINT, signal.SIG_DFL" not in src, path  # the preamble pasted, not called
        if "stop_on_ctrl_c" not in src:
            continue
        tree = ast.parse(src)
        doc = ast.get_docstring(tree, clean=False) or ""
        assert "stop_on_ctrl_c" not in doc, path
        calls = [ast.unparse(n) for n in tree.body[:4] if isinstance(n, ast.Expr)]
        assert "stop_on_ctrl_c(__name__)" in calls, path
        found += 1
    assert found >= 13, found
    before = signal.getsignal(signal.SIGINT)
    try:
        stop_on_ctrl_c("tools.export")  # imported, not run: left alone
        assert signal.getsignal(signal.SIGINT) is before
        stop_on_ctrl_c("__main__")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)


# ----------------------------------------------------------------------------- the flags and train.py's order


def test_every_flag_of_train_py_is_on_one_page_that_reads_no_file():
    """tools/config.py holds every field of TrainConfig (no base class brings more from elsewhere), each with a
    --help line, and imports of this repository only the parser and model.py's GPTConfig: no module that reads
    a file (checkpoints, shards, pretrained models), so the flag page sits low in the house."""
    import dataclasses
    import sys
    from tools import config, flags
    tree = _tree("tools/config.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    declared = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert not cls.bases and declared == [f.name for f in dataclasses.fields(config.TrainConfig)]
    comments = flags.field_comments(config.TrainConfig)
    assert all(comments.get(name) for name in declared), [n for n in declared if not comments.get(n)]
    ours = _imports(tree) - set(sys.stdlib_module_names) - ALLOWED
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert ours <= {"tools", "model"} and modules - set(sys.stdlib_module_names) <= {"tools.flags", "model"}, modules


def test_train_py_reads_schedules_step_loop_loss_set_up_checks_with_the_step_on_its_first_screens():
    """train.py in the order a learner reads it: the schedules, train_step, the loop, each stage's loss, the
    set-up, then the checks of the schedule flags; train_step starts within 100 lines of the docstring's end."""
    tree = _tree("train.py")
    line = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    order = ["lr_mult", "lambda_at", "train_step", "training_loop", "make_loss_fn", "setup",
             "configure_optimizer", "check_quant_start", "check_lambda_on_resume", "main"]
    assert [line[n] for n in order] == sorted(line[n] for n in order), {n: line[n] for n in order}
    assert line["train_step"] - tree.body[0].end_lineno <= 100, (line["train_step"], tree.body[0].end_lineno)


def test_no_function_reads_a_name_its_module_never_binds():
    """Code that only a GPU runs (lab.bench's CUDA rows, the decode benchmark's preset model) never runs
    in this suite, so a name it reads that its module never binds (an import left out) would first
    fail on a GPU, in the one short window a session gets there. Python's own symbol tables find
    every such read: a name a function takes from its module's globals must be bound there (assigned,
    imported, a def or class) or be a builtin."""
    import builtins
    import subprocess
    import symtable
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(files) > 50, files
    unbound = []
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            top = symtable.symtable(f.read(), path, "exec")
        known = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
                 or s.is_namespace()} | set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__"}
        tables = top.get_children()
        while tables:
            t = tables.pop()
            tables += t.get_children()
            unbound += [f"{path}: {t.get_name()}() reads {s.get_name()}" for s in t.get_symbols()
                        if s.is_referenced() and s.is_global() and not s.is_declared_global()
                        and s.get_name() not in known]
    assert unbound == [], unbound
