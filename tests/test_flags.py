"""tools/flags.py: the one --key=value parser and error path of every command, and --help from field comments.
Run: python -m pytest tests/test_flags.py"""

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import ENV, ROOT, fails
from tools import flags


@dataclass
class Demo:
    steps: int = 3               # how many steps
    rate: float = 0.5            # a rate
    name: str = "x"              # a name; this comment goes on
                                 # onto a second line
    fast: bool = False           # a switch
    # a heading, not a continuation
    plain: int = 0


def test_parse_types_booleans_and_the_bare_boolean_flag():
    got = flags.parse(["--steps=7", "--rate=1e-3", "--name=y", "--fast=on"], Demo)
    assert got == {"steps": 7, "rate": 1e-3, "name": "y", "fast": True}
    for word, want in (("true", True), ("1", True), ("yes", True), ("ON", True), ("false", False), ("0", False),
                       ("no", False), ("Off", False)):
        assert flags.parse([f"--fast={word}"], Demo) == {"fast": want}
    assert flags.parse(["--fast"], Demo) == {"fast": True}


@pytest.mark.parametrize("argv, facts", [(["--steps=x"], ["--steps=x", "an integer"]),
                                         (["--rate=fast"], ["--rate=fast", "a number"]),
                                         (["--fast=maybe"], ["--fast=maybe", "true or false"]),
                                         (["--nope=1"], ["--nope=1", "steps, rate, name, fast, plain"]),
                                         (["steps=1"], ["steps=1"]), (["--steps"], ["--steps"])])
def test_a_bad_flag_is_one_error_line_and_exit_2(capsys, argv, facts):
    with pytest.raises(SystemExit) as e:
        flags.parse(argv, Demo)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and all(f in err[0] for f in facts)


def test_help_lists_every_field_with_its_default_and_comment_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        flags.parse(["--help"], Demo, "demo: what it does")
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("demo: what it does")
    assert "--steps=3" in out and "how many steps" in out and "--fast=false" in out
    assert "a name; this comment goes on onto a second line" in out and "heading" not in out
    assert flags.field_comments(Demo) == {"steps": "how many steps", "rate": "a rate", "fast": "a switch",
                                          "name": "a name; this comment goes on onto a second line"}


def test_a_renamed_flag_is_one_error_line_naming_its_new_name(capsys):
    for argv, facts in ((["--old_steps=7"], ["--old_steps", "is now --steps", "--steps=7"]),
                        (["--old_steps"], ["--old_steps", "is now --steps"])):
        with pytest.raises(SystemExit) as e:
            flags.parse(argv, Demo, renamed={"old_steps": "steps"})
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and all(f in err[0] for f in facts)
    assert flags.parse(["--steps=7"], Demo, renamed={"old_steps": "steps"}) == {"steps": 7}


def test_converters_and_positional_arguments():
    got = flags.parse(["a.txt", "--steps=2", "b.txt"], Demo, positional="FILE ...")
    assert got == ({"steps": 2}, ["a.txt", "b.txt"])
    with pytest.raises(SystemExit):
        flags.parse(["a.txt"], Demo)  # a command without positional arguments refuses one


# every command: --help exits 0 and describes every flag; a bad flag is refused the same way everywhere. In this
# process (each subprocess costs a torch import); train.py's real entry point once as a subprocess.
COMMANDS = [("train", "main", "tools.config", "TrainConfig"), ("sample", "main", "sample", "SampleConfig"),
            ("tools.export", "main", "tools.export", "ExportConfig"),
            ("tools.prepare", "main", "tools.prepare", "PrepareConfig"), ("lab.runner", "main", "lab.runner", "LabFlags"),
            ("lab.bench", "main", "lab.bench", "BenchFlags"),
            ("lab.check_llamacpp", "main", "lab.check_llamacpp", "CheckFlags"),
            ("tools.make_python_corpus", "main", "tools.make_python_corpus", "CorpusFlags"),
            ("tools.plot", "main", "tools.plot", "PlotFlags")]


@pytest.mark.parametrize("module, func, home, cls", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_command_has_help_and_the_same_error_path(capsys, module, func, home, cls):
    import importlib
    main = getattr(importlib.import_module(module), func)
    flag_class = getattr(importlib.import_module(home), cls)
    comments = flags.field_comments(flag_class)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for f in dataclasses.fields(flag_class):
        assert f"--{f.name}=" in out and comments.get(f.name) and comments[f.name] in out, f.name
    with pytest.raises(SystemExit) as e:
        main(["--no_such_flag=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--no_such_flag=1" in err[0] and err[0].startswith("error: ")


@pytest.mark.parametrize("flag", ["--n_layer=0", "--n_layer=-1", "--tokens=0", "--reps=0"])
def test_packed_decode_refuses_counts_below_one_in_one_line(capsys, flag):
    """lab.packed_decode's counts (a ValueError, a ZeroDivisionError and a StatisticsError traceback before)."""
    from lab import packed_decode
    assert flag in fails(capsys, flag, code=2, main=packed_decode.main)


@pytest.mark.slow
def test_train_py_help_from_the_command_line():
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "--lambda_warmup_steps=200" in p.stdout and "--grad_accum=8" in p.stdout


def test_only_tools_flags_parses_command_lines():
    """One parser: no other module reads sys.argv as --key=value pairs by hand."""
    hits = []
    for d, _, files in os.walk(ROOT):
        if any(part in d for part in (".git", "tests", "__pycache__")):
            continue
        for name in files:
            if name.endswith(".py"):
                src = open(os.path.join(d, name), encoding="utf-8").read()
                if 'partition("=")' in src and name != "flags.py":
                    hits.append(os.path.relpath(os.path.join(d, name), ROOT))
    assert hits == []


@pytest.mark.parametrize("module, func, home, cls", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_bare_flag_means_true_for_a_boolean_only_in_every_command(capsys, module, func, home, cls):
    """Every flag of every command given bare: a boolean is true; any other (a bare --out_dir is not the string
    "true", which would write into ./true) is one error line naming it, exit 2, before the command does anything
    (its main() is called, so a command's own converters count too)."""
    import importlib
    main = getattr(importlib.import_module(module), func)
    flag_class = getattr(importlib.import_module(home), cls)
    others = [f.name for f in dataclasses.fields(flag_class) if flags._type(f) is not bool]
    assert others  # every command has flags that take a value
    for name in others:  # a second, unknown flag: were the bare one accepted, the command still would not run
        msg = fails(capsys, f"--{name}", "--no_such_flag=1", code=2, main=main)
        assert msg.startswith(f"error: --{name} needs a value, e.g. --{name}="), msg
    for f in dataclasses.fields(flag_class):
        if flags._type(f) is bool:
            assert flags.parse([f"--{f.name}"], flag_class) == {f.name: True}


def test_die_names_the_global_rank_not_the_local_one(capsys, monkeypatch):
    """Under torchrun a rank other than 0 prefixes its error line with its RANK (over all nodes): rank 9 is the
    second process of the second node (LOCAL_RANK=1), and rank 8 (LOCAL_RANK=0 there) is not rank 0."""
    def boom(argv):
        flags.die("boom")
    for env, want in (({"RANK": "9", "LOCAL_RANK": "1"}, "error: [rank 9] boom"),
                      ({"RANK": "8", "LOCAL_RANK": "0"}, "error: [rank 8] boom"),
                      ({"RANK": "0", "LOCAL_RANK": "0"}, "error: boom"), ({}, "error: boom")):
        for k in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert fails(capsys, code=1, main=boom) == want, env


def test_ctrl_c_while_a_command_loads_its_imports_stops_it_without_a_traceback():
    """Ctrl-C in the first seconds of any command (torch, transformers, matplotlib loading) prints no
    KeyboardInterrupt traceback: each entry point stops at once (killed by SIGINT, as a shell expects), and its
    flags.parse hands Ctrl-C back to Python (KeyboardInterrupt, which train.py's stop handler replaces)."""
    import signal
    import subprocess
    import time
    commands = [["train.py"], ["sample.py"], ["-m", "tools.prepare"], ["-m", "tools.export"], ["-m", "tools.plot"],
                ["-m", "lab"], ["-m", "lab.bench"], ["-m", "lab.check_llamacpp"]]
    procs = [subprocess.Popen([sys.executable, *c, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    for p in procs:  # once torch's library is mapped, the command is loading its imports (seconds more here)
        deadline = time.time() + 30
        while "libtorch" not in open(f"/proc/{p.pid}/maps").read() and time.time() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
    for c, p in zip(commands, procs):
        out, err = p.communicate(timeout=60)
        assert "Traceback" not in err and p.returncode == -signal.SIGINT, (c, p.returncode, err[-300:])


def test_parse_gives_ctrl_c_back_to_python_after_the_imports():
    import signal
    from dataclasses import dataclass

    @dataclass
    class F:
        n: int = 1
    before = signal.signal(signal.SIGINT, signal.SIG_DFL)  # as an entry point leaves it while importing
    try:
        assert flags.parse(["--n=2"], F) == {"n": 2}
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
