"""tools/atomic.py: a write that fails or is stopped leaves the old file (or directory) whole and no temporary one,
and removes only what its own writers left; StopSignal. tools/outputs.py: file_kind tells every kind of output apart;
check_output refuses what would lose a file. tools/load.py: load_gpt builds the same model from a checkpoint, an
average or a packed export, loads old checkpoints, and names what is not one.
Run: python -m pytest tests/test_atomic.py"""

import dataclasses
import errno
import os
import signal
import time

import pytest
import torch

from conftest import fails
from kernels.packed_linear import freeze_ternary
from model import GPT, GPTConfig
from tools import atomic, checkpoint, export, load, outputs

TINY = GPTConfig(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_embd=32)  # the byte tokenizer's vocabulary


def test_root_is_the_repository():
    assert atomic.ROOT == os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.exists(os.path.join(atomic.ROOT, "train.py"))

# -----------------------------------------------------------------------------
# atomic_write, atomic_dir


def test_atomic_write_replaces_the_file_only_when_the_write_completes(tmp_path):
    path = str(tmp_path / "f")
    open(path + ".tmp", "w").write("mine")  # a user's file: no writer's host and pid in its name, never ours
    with atomic.atomic_write(path) as tmp:
        assert tmp.startswith(path + ".") and tmp.endswith(".tmp") and not os.path.exists(tmp)
        open(tmp, "w").write("old")
    assert open(path).read() == "old" and open(path + ".tmp").read() == "mine"
    os.remove(path + ".tmp")
    for error in (OSError(errno.ENOSPC, "No space left on device"), RuntimeError("unexpected pos 64 vs 0"),
                  KeyboardInterrupt(), SystemExit(1)):
        with pytest.raises(type(error)):
            with atomic.atomic_write(path) as tmp:
                open(tmp, "w").write("half")
                raise error
        assert open(path).read() == "old" and os.listdir(tmp_path) == ["f"], error  # the old file whole, no .tmp


def test_two_atomic_writes_of_one_path_never_share_a_temporary_file(tmp_path, capsys):
    """Two writers of one path (two exports to one --out) each write their own tmp: neither removes nor overwrites
    the other's half-written file; the last to finish wins whole. A leftover of a writer that is gone is removed,
    a running writer's is left alone."""
    import subprocess
    import sys
    path = str(tmp_path / "f")
    with atomic.atomic_write(path) as a:
        open(a, "w").write("first, half written")
        with atomic.atomic_write(path) as b:
            assert b != a and os.path.exists(a)  # the second writer did not remove the first one's file
            open(b, "w").write("second")
        assert open(a).read() == "first, half written"
        open(a, "a").write(" and finished")
    assert open(path).read() == "first, half written and finished" and os.listdir(tmp_path) == ["f"]
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = int(done.stdout), atomic._host()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for n in (f"f.{host}_{dead}_a1.tmp", f"f.{host}_{live.pid}_b2.tmp"):
            open(tmp_path / n, "w").write("left")
        with atomic.atomic_write(path) as tmp:
            open(tmp, "w").write("new")
        assert sorted(os.listdir(tmp_path)) == ["f", f"f.{host}_{live.pid}_b2.tmp"]
        assert capsys.readouterr().out == f"removed {tmp_path}/f.{host}_{dead}_a1.tmp, left by a writer of {path} " \
                                          f"that is gone\n"  # what is removed is named
    finally:
        live.kill()
        live.wait()



def test_a_symlinked_output_is_written_through_and_stays_a_link(tmp_path):
    """An output path that is a symlink (out/stage2/hf -> a bigger disk; a link to the file kept elsewhere):
    the file or directory it names gets the new content and the link stays a link. (Before: the link was
    replaced by a plain file or directory beside it, and what it named kept the old output.) The error line of a
    failed write names the free space of the disk the link leads to."""
    keep, links = tmp_path / "keep", tmp_path / "links"
    keep.mkdir(), links.mkdir()
    (keep / "out.txt").write_text("old")
    (links / "out.txt").symlink_to(keep / "out.txt")
    with atomic.atomic_write(str(links / "out.txt")) as tmp:
        open(tmp, "w").write("new")
    assert (links / "out.txt").is_symlink() and (keep / "out.txt").read_text() == "new"
    (keep / "hf").mkdir()
    (keep / "hf" / "a").write_text("old")
    (links / "hf").symlink_to(keep / "hf", target_is_directory=True)
    with atomic.atomic_dir(str(links / "hf")) as tmp:
        open(os.path.join(tmp, "b"), "w").write("new")
    assert (links / "hf").is_symlink() and sorted(os.listdir(keep / "hf")) == ["b"]
    assert sorted(os.listdir(links)) == ["hf", "out.txt"]  # nothing left beside the links
    why, disk, fix = atomic.write_failed(OSError(errno.ENOSPC, "No space left on device"), str(links / "out.txt"))
    assert f"the disk holding {keep} has" in disk and fix == "free disk space"
    # a write refused for permission or a read-only mount is not blamed on the disk's space
    for code, cause in ((errno.EACCES, "does not let this user write"), (errno.EPERM, "immutable flag"),
                        (errno.EROFS, "read-only")):
        why, what, fix = atomic.write_failed(OSError(code, os.strerror(code)), str(links / "out.txt"))
        assert why == os.strerror(code) and cause in what and "free" not in what + fix, (what, fix)
        assert fix == f"make {keep / 'out.txt'} and its directory writable", fix


def test_written_turns_a_failed_write_into_one_line_and_keeps_the_old_file(tmp_path, capsys):
    """atomic.written (the outputs of sample.py --jsonl, lab.mask_outliers, lab.check_llamacpp, the lab's results):
    the disk filling mid-write ends the command with one error line naming the flag and path and the free space,
    exit 1, the old file whole, no temporary file left."""
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(SystemExit) as e:
        with atomic.written(str(path), "--out") as tmp, open(tmp, "w") as f:
            f.write("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out={path}: cannot write it (No space left on device); the disk holding"), err
    assert "the file there, if any, is unchanged; free disk space or pass another --out" in err, err
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    with atomic.written(str(path)) as tmp:
        open(tmp, "w").write("new")
    assert path.read_text() == "new"

def test_atomic_dir_swaps_in_the_whole_directory_or_nothing(tmp_path):
    path = str(tmp_path / "d")
    with atomic.atomic_dir(path) as tmp:
        open(os.path.join(tmp, "a"), "w").write("1")
    assert os.listdir(path) == ["a"] and os.stat(path).st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's 0700
    with pytest.raises(OSError):
        with atomic.atomic_dir(path) as tmp:
            open(os.path.join(tmp, "b"), "w").write("2")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(path) == ["a"] and os.listdir(tmp_path) == ["d"]
    with atomic.atomic_dir(path) as tmp:
        open(os.path.join(tmp, "b"), "w").write("2")
    assert os.listdir(path) == ["b"] and os.listdir(tmp_path) == ["d"]  # the old directory is gone, not merged


def test_atomic_dir_clears_what_dead_writers_left_but_not_a_running_writers_directories(tmp_path):
    """Leftovers carry their writer's host and pid: a killed export's .tmp (and an old directory, with path
    present) go; another export still writing beside the same path (two exports into one directory) keeps its own;
    a name without a writer's pid (.d.tmp-k1ll3d) is not provably a writer's and stays."""
    import subprocess
    import sys
    path = str(tmp_path / "d")
    os.mkdir(path)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = done.stdout.strip(), atomic._host()  # a pid that has exited
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for n in (f".d.tmp_{host}_{dead}_a1", f".d.old_{host}_{dead}_a1", f".d.tmp_{host}_{live.pid}_b2",
                  f".d.old_{host}_{live.pid}_b2", ".d.tmp-k1ll3d"):
            os.mkdir(tmp_path / n)
        with atomic.atomic_dir(path) as tmp:
            assert os.path.basename(tmp).startswith(f".d.tmp_{host}_{os.getpid()}_")
            open(os.path.join(tmp, "a"), "w").write("1")
        assert sorted(os.listdir(tmp_path)) == [f".d.old_{host}_{live.pid}_b2", ".d.tmp-k1ll3d",
                                                f".d.tmp_{host}_{live.pid}_b2", "d"]
    finally:
        live.kill()
        live.wait()


def _started(pid):
    """Field 22 of /proc/<pid>/stat (read here, independently of tools/atomic.py): when the process started."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="no /proc: pids carry no start time")
def test_atomic_dir_tells_a_dead_writers_reused_pid_from_the_writer(tmp_path):
    """A leftover's name carries its writer's pid and start time: the pid now running another process (this one, or
    a child), which started at another time, is not that writer, so its leftovers go; the same pid with the start
    time it has now is a running writer's, and stays. A name without a start (<host>_<pid>) is judged by the pid."""
    import subprocess
    import sys
    path = str(tmp_path / "d")
    os.mkdir(path)
    host, me = atomic._host(), os.getpid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine, theirs = _started(me), _started(live.pid)
        reused = [f".d.tmp_{host}_{me}_{mine - 1}_a1", f".d.old_{host}_{me}_{mine + 7}_a1",
                  f".d.tmp_{host}_{live.pid}_{theirs + 1}_a2"]
        running = [f".d.tmp_{host}_{live.pid}_{theirs}_b2", f".d.old_{host}_{live.pid}_{theirs}_b2",
                   f".d.tmp_{host}_{me}_{mine}_b3", f".d.tmp_{host}_{live.pid}_b4"]
        for n in reused + running:
            os.mkdir(tmp_path / n)
        with atomic.atomic_dir(path) as tmp:
            assert os.path.basename(tmp).startswith(f".d.tmp_{host}_{me}_{mine}_")
            open(os.path.join(tmp, "a"), "w").write("1")
        assert sorted(os.listdir(tmp_path)) == sorted(running + ["d"])
    finally:
        live.kill()
        live.wait()


def test_atomic_dir_leaves_a_users_directories_named_like_its_leftovers_alone(tmp_path):
    """Only what a writer provably left is removed or put back: a directory beside --out whose name carries no
    writer's host and pid (.hf.old-backup, .hf.tmp-mine, ...) is the user's, also when --out is missing (where a
    writer killed mid-swap would have left its old directory)."""
    names = (".hf.old-backup", ".hf.tmp-mine", ".hf.old_backup", ".hf.tmp_mine", ".hf.tmp_k2j3h4g5")
    for n in names:
        os.mkdir(tmp_path / n)
        (tmp_path / n / "mine.txt").write_text(n)
        os.utime(tmp_path / n, (time.time() - 2 * atomic.STALE_AFTER_S,) * 2)  # however old
    path = str(tmp_path / "hf")
    for new in ("1", "2"):  # --out missing, then there
        with atomic.atomic_dir(path) as tmp:
            open(os.path.join(tmp, "a"), "w").write(new)
        assert os.listdir(path) == ["a"] and open(os.path.join(path, "a")).read() == new
        assert sorted(os.listdir(tmp_path)) == sorted(names + ("hf",))
        assert all((tmp_path / n / "mine.txt").read_text() == n for n in names)
    os.rename(path, tmp_path / "elsewhere")
    assert atomic.swapped_out(path) is None  # no old directory of a writer: nothing to tell a reader

def test_atomic_dir_puts_the_old_directory_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    path, renames = str(tmp_path / "d"), []
    os.mkdir(path)
    open(os.path.join(path, "a"), "w").write("1")
    real = os.rename

    def second_fails(src, dst):
        renames.append(dst)
        if len(renames) == 2:  # path -> .d.old_<owner>_<random> went through; tmp -> path does not
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)
    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError):
        with atomic.atomic_dir(path) as tmp:
            open(os.path.join(tmp, "b"), "w").write("2")
    monkeypatch.undo()
    assert renames[0] != path and os.listdir(path) == ["a"] and os.listdir(tmp_path) == ["d"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask

# -----------------------------------------------------------------------------
# file_kind and check_output


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training checkpoint (ckpt.pt, with its hard link ckpt_000000.pt), an average and a packed export of TINY."""
    d = tmp_path_factory.mktemp("common")
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    ckpt = {"step": 0, "model_args": dataclasses.asdict(TINY), "model": model.state_dict(),
            "config": {"tokenizer": "byte"}}
    checkpoint.save(ckpt, str(d))
    torch.save({**ckpt, "averaged": {"steps": [0], "alpha": 0.0}}, d / "avg.pt")
    frozen = GPT(TINY).eval()
    frozen.load_state_dict(model.state_dict())
    obj = export.packed_state(freeze_ternary(frozen), "byte")
    torch.save({**obj, "source": str(d / "ckpt.pt")}, d / "packed.pt")
    return d, model


def test_file_kind_tells_every_output_apart(saved, tmp_path):
    d, model = saved
    assert outputs.file_kind(str(d / "ckpt.pt")) == ("checkpoint", None)
    assert outputs.file_kind(str(d / "avg.pt")) == ("average", None)
    assert outputs.file_kind(str(d / "packed.pt")) == ("packed", str(d / "ckpt.pt"))
    export.write_gguf(model, "byte", str(tmp_path / "m.gguf"), source="/runs/a/ckpt.pt")
    assert outputs.file_kind(str(tmp_path / "m.gguf")) == ("gguf", "/runs/a/ckpt.pt")
    export.write_gguf(model, "byte", str(tmp_path / "published.gguf"))  # no checkpoint recorded: not an export
    assert outputs.file_kind(str(tmp_path / "published.gguf")) == ("gguf-model", None)
    hf = str(tmp_path / "hf")
    export.write_hf(model, "byte", hf, source="/runs/a/ckpt.pt")
    assert outputs.file_kind(hf) == ("hf", "/runs/a/ckpt.pt")
    assert outputs.file_kind(os.path.join(hf, "model.safetensors")) == ("hf-file", hf)
    os.rename(os.path.join(hf, "model.safetensors"), tmp_path / "model.safetensors")  # outside an export of ours
    assert outputs.file_kind(str(tmp_path / "model.safetensors"))[0] == "safetensors"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("words\n")
    (tmp_path / "bytes").write_bytes(bytes(range(256)))
    assert [outputs.file_kind(str(tmp_path / n))[0] for n in ("metrics.jsonl", "notes.txt", "bytes")] == [
        "metrics", "text", "other"]
    assert outputs.file_kind(str(tmp_path)) == ("directory", None)


def test_check_output_refuses_the_input_another_kind_and_another_source(saved, tmp_path, capsys):
    d, model = saved
    ckpt, numbered, packed = str(d / "ckpt.pt"), str(d / "ckpt_000000.pt"), str(d / "packed.pt")
    src = os.path.abspath(ckpt)

    def refusal(path, kind, source=src, overwrite=False, code=2):
        return fails(capsys, code=code, main=lambda argv: outputs.check_output(
            "--out", path, kind, source, overwrite, [("--ckpt", ckpt)]))
    for overwrite in (False, True):
        assert "same file as --ckpt" in refusal(numbered, "packed", overwrite=overwrite)  # a hard link of the input
        msg = refusal(str(d / "avg.pt"), "packed", overwrite=overwrite)  # another kind: never
        assert "checkpoint average" in msg and "another kind" in msg
    outputs.check_output("--out", packed, "packed", src)  # made from the same checkpoint: a re-export replaces it
    msg = refusal(packed, "packed", source="/elsewhere/ckpt.pt")
    assert "another checkpoint" in msg and ckpt in msg and "--overwrite=True" in msg
    outputs.check_output("--out", packed, "packed", "/elsewhere/ckpt.pt", True)  # asked for
    msg = refusal(str(tmp_path / "no" / "packed.pt"), "packed", code=1)
    assert "does not exist" in msg and "mkdir -p" in msg
    assert "is a directory" in refusal(str(tmp_path), "packed")
    outputs.check_output("--out", str(tmp_path / "new.pt"), "packed", src)  # nothing there: fine
    # a published GGUF model (no checkpoint of ours recorded in it; with --overwrite=True it was replaced)
    from tools import export
    export.write_gguf(model, "byte", str(tmp_path / "smol.gguf"))
    for overwrite in (False, True):
        msg = refusal(str(tmp_path / "smol.gguf"), "gguf", overwrite=overwrite)
        assert "a GGUF model as published" in msg and "not even with --overwrite=True" in msg, msg
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(open(ckpt, "rb").read())
    msg = fails(capsys, code=2, main=lambda argv: outputs.check_output(
        "--out", str(tmp_path), "hf", src, True, [("--ckpt", str(run / "ckpt.pt"))]))
    assert "holds --ckpt" in msg  # swapping in a new directory there would delete the checkpoint

# -----------------------------------------------------------------------------
# StopSignal and stoppable


def _signal(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.01)


def test_stop_signal_is_a_flag_then_stops_at_once_and_can_pass_signals_on():
    before = signal.getsignal(signal.SIGTERM)
    with atomic.StopSignal() as stop:
        _signal(signal.SIGINT)
        _signal(signal.SIGTERM)  # another kind (torchrun's SIGTERM after a Ctrl-C): not an abort
        assert stop.requested == "SIGINT"
        with pytest.raises(atomic.Interrupted) as e:
            _signal(signal.SIGINT)
        assert e.value.signum == signal.SIGINT and e.value.code.startswith("error: second SIGINT")
    assert signal.getsignal(signal.SIGTERM) is before
    passed = []
    with atomic.StopSignal(forward=lambda s: passed.append(s) or True) as stop:
        _signal(signal.SIGTERM)
        _signal(signal.SIGTERM)  # passed on both times: the child decides
    assert passed == [signal.SIGTERM] * 2 and stop.requested == "SIGTERM"
    with pytest.raises(atomic.Interrupted, match="SIGTERM: before anything"):
        with atomic.StopSignal(at_once="before anything"):
            _signal(signal.SIGTERM)


def test_stoppable_says_whether_the_output_was_written(tmp_path, capsys):
    path = str(tmp_path / "f")
    open(path, "w").write("old")

    def stopped(argv, commit):
        with atomic.stoppable("--out", path):
            with atomic.atomic_write(path) as tmp:
                open(tmp, "w").write("new")
                if not commit:
                    _signal(signal.SIGTERM)
            if commit:
                _signal(signal.SIGTERM)
    msg = fails(capsys, code=128 + signal.SIGTERM, main=lambda argv: stopped(argv, False))
    assert "SIGTERM" in msg and f"--out={path} is unchanged" in msg and open(path).read() == "old"
    msg = fails(capsys, code=128 + signal.SIGTERM, main=lambda argv: stopped(argv, True))
    assert "written whole" in msg and open(path).read() == "new" and os.listdir(tmp_path) == ["f"]



def test_stoppable_names_the_signal_when_c_code_replaced_its_exception(tmp_path, capsys):
    """A SIGTERM whose handler ran inside C code that put its own error in place of the handler's exception
    (numpy's tofile, writing a shard: a TypeError, found in CI) still ends in the one line naming the signal and
    its exit code, and a bare StopSignal(at_once=...) raises Interrupted; an error with no signal behind it is
    left as it is."""
    path = str(tmp_path / "f")

    def numpy_like():  # what numpy's tofile did with the handler's exception
        try:
            _signal(signal.SIGTERM)
        except atomic.Interrupted:
            raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter") from None

    def stopped(argv):
        with atomic.stoppable("--out", path):
            numpy_like()
    msg = fails(capsys, code=128 + signal.SIGTERM, main=stopped)
    assert "stopped by SIGTERM" in msg and f"--out={path} was not written" in msg, msg
    with pytest.raises(TypeError):
        with atomic.stoppable("--out", path):
            raise TypeError("a bug, not a signal")
    with pytest.raises(atomic.Interrupted, match="SIGTERM: before training"):  # train.py's kind
        with atomic.StopSignal(at_once="before training"):
            numpy_like()

# -----------------------------------------------------------------------------
# load_gpt


def test_load_gpt_builds_the_same_model_from_a_checkpoint_an_average_and_an_export(saved):
    d, model = saved
    idx = torch.randint(0, 257, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(idx, idx)[0]
        for name in ("ckpt.pt", "avg.pt", "packed.pt"):
            got, obj = load.load_gpt(str(d / name))
            assert not got.training and outputs.saved_tokenizer(obj) == "byte"
            assert torch.allclose(got(idx, idx)[0], want, atol=1e-5), name  # packed: integer path, same codes


def test_load_gpt_names_model_args_this_model_does_not_have(saved, tmp_path):
    """model_args with a key GPTConfig does not have (another program's, a damaged file): one line naming it."""
    d, model = saved
    ckpt = torch.load(d / "ckpt.pt", weights_only=True)
    ckpt["model_args"] = dict(ckpt["model_args"], track_max_logit=True)
    torch.save(ckpt, tmp_path / "old.pt")
    with pytest.raises(checkpoint.CheckpointError) as e:
        load.load_gpt(str(tmp_path / "old.pt"))
    assert "track_max_logit" in str(e.value) and "old.pt" in str(e.value) and "\n" not in str(e.value)


def test_load_gpt_names_what_is_not_a_checkpoint_and_which_program_reads_it(saved, tmp_path):
    """A GGUF file, an HF export directory, model.safetensors or nanobitnet.json is named for what it is, not called
    "corrupt or truncated" (nor a KeyError)."""
    d, model = saved
    ckpt = str(d / "ckpt.pt")
    gguf, hf = str(tmp_path / "model.gguf"), str(tmp_path / "hf")
    export.write_gguf(model, "byte", gguf, source=ckpt)
    export.write_hf(model, "byte", hf, source=ckpt)
    cases = {gguf: ("GGUF", "llama.cpp"), hf: ("HF export directory", "from_pretrained"),
             os.path.join(hf, "model.safetensors"): ("HF export directory", "from_pretrained"),
             os.path.join(hf, "nanobitnet.json"): ("HF export directory", "from_pretrained")}
    for path, facts in cases.items():
        with pytest.raises(checkpoint.CheckpointError) as e:
            load.load_gpt(path)
        msg = str(e.value)
        assert path in msg and all(f in msg for f in facts) and ckpt in msg and "corrupt" not in msg, msg
    with pytest.raises(checkpoint.CheckpointError, match="train one first"):
        load.load_gpt(str(tmp_path / "missing.pt"))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated"):
        load.load_gpt(str(tmp_path / "bad.pt"))


def test_atomic_write_syncs_the_new_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """Durability: the temp file's bytes reach the disk (fsync of the file) before it is renamed over the path, and
    the rename itself (fsync of the directory) after; otherwise a power cut could leave an empty file under the
    final name."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("replace", str(b))) or real_rename(a, b))
    path = str(tmp_path / "f.txt")
    with atomic.atomic_write(path) as tmp:
        open(tmp, "w").write("new")
    kinds = [e[0] for e in events]
    at = kinds.index("replace")
    assert any(k == "fsync" and p.endswith(".tmp") for k, p in events[:at]), events  # the file, before
    assert ("fsync", str(tmp_path)) in events[at:], events  # the directory, after
    assert open(path).read() == "new"


def test_another_hosts_fresh_leftover_is_kept_even_if_its_pid_runs_nowhere_here(tmp_path):
    """A .tmp named for another host (a shared disk) is judged by its age only: this machine's pid table says
    nothing about that host's writer. A fresh one stays (its writer may be live); one older than STALE_AFTER_S goes."""
    path = str(tmp_path / "f.txt")
    dead_pid = 2**22 + 12345  # above pid_max: no process here has it
    fresh = f"{path}.otherhost_{dead_pid}_1_00ff00ff.tmp"
    old = f"{path}.otherhost_{dead_pid}_1_11aa11aa.tmp"
    mine = f"{path}.{atomic._host()}_{dead_pid}_1_22bb22bb.tmp"
    for p in (fresh, old, mine):
        open(p, "w").close()
    then = time.time() - atomic.STALE_AFTER_S - 60
    os.utime(old, (then, then))
    assert sorted(atomic.stale_tmps(path)) == sorted([old, mine])


def test_a_mount_point_as_the_output_directory_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                      monkeypatch):
    """A directory swapped in whole (tools.prepare --out_dir, an HF export) cannot replace a mount point (the
    rename fails: EBUSY): refused before a byte is written, in one line naming it and a directory inside it,
    never "free disk space"."""
    from tools import prepare
    mount = str(tmp_path / "mnt")
    os.mkdir(mount)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.abspath(p) == mount or real(p))
    wrote = []
    monkeypatch.setattr(prepare, "iter_documents", lambda *a: wrote.append(a) or iter(()))
    src = tmp_path / "a.txt"
    src.write_text("one\n\ntwo\n")
    assert prepare.main([str(src), f"--out_dir={mount}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and f"{mount} is a mount point" in err and f"{mount}/out" in err and "free disk space" not in err, err
    assert wrote == [] and os.listdir(mount) == [] and sorted(os.listdir(tmp_path)) == ["a.txt", "mnt"]
