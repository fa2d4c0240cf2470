"""The tests' fast `python train.py`: a process that imports torch, torch._dynamo (which the first optimizer
imports), transformers' Llama and the repository's modules once, then forks one child per run. Each child is a process of its own,
with its own pid, working directory, environment, stdin/stdout/stderr files, signals and exit status, and runs
the script as `__main__` exactly as `python <script> <args>` would; only the ~3 s of imports are shared. This
process runs nothing itself, so every child starts from the same freshly imported state.

Started by tests/conftest.py (one per pytest worker, with conftest's ENV), which writes one JSON request per line
to stdin: {"argv": [script, *args], "cwd", "env", "stdout", "stderr", "status"} (paths); the answer is the child's
pid on stdout. When the child ends, its exit status (negative: the signal that ended it, as Popen says it) is
written to the "status" file. An argv of ["-m", module, *args] runs `python -m module <args>` (runpy.run_module).
Run: python -m pytest (conftest.run and conftest.start use it).
"""

import json
import os
import signal
import sys

import torch
import torch._dynamo  # noqa: F401 (torch.optim's first optimizer imports it: ~1.3 s of every run)

import sample  # noqa: F401
import train  # noqa: F401
from tools import export, prepare, pretrained  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401 (an --init_from run's)

STATUS = {}  # child pid -> the file its exit status goes to


def reap(*_):
    """SIGCHLD: record the exit status of every child that ended (atomically: the reader polls for the file)."""
    while STATUS:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = STATUS.pop(pid, None)
        if path:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


def child(req):
    """In the forked child: become `python <script> <args>` and never return."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's handlers
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    for fd, path in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_RDONLY) if fd == 0 else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    code = 0
    try:
        import runpy
        if req["argv"][0] == "-m":  # python -m <module> <args>: the working directory leads sys.path
            sys.argv = ["-m", *req["argv"][2:]]  # run_module puts the module's file in sys.argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(req["argv"][1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(req["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
            runpy.run_path(req["argv"][0], run_name="__main__")
    except SystemExit as e:  # as the interpreter exits: None is 0, a message is printed and is 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the interpreter's traceback, then death by SIGINT
        import traceback
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def main():
    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is pytest's to handle
    for line in sys.stdin:  # ends when the pytest worker does
        req = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # the pid is in STATUS before reap can see it
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            child(req)
        STATUS[pid] = req["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        print(pid, flush=True)
        reap()


if __name__ == "__main__":
    main()
