"""
Rebuild data/python.jsonl.gz, the shipped code corpus: the top-level modules Lib/*.py of CPython 3.11.7, one
JSON document per file, {"title": "Lib/<name>.py", "text": <the file>}, in file-name order. The files are read
from the standard library of a CPython 3.11.7 installation (`make install` copies Lib/*.py unchanged);
_sysconfigdata_*.py is left out, because the build writes it (it is not in the source release).
The gzip header carries no name and no time, so the output is the same bytes on every machine.

    python -m tools.make_python_corpus              # needs CPython 3.11.7; checks the sha256 in data/README.md
"""
from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import glob
import gzip
import hashlib
import io
import json
import os
import sys
import sysconfig
from dataclasses import dataclass

from tools.atomic import ROOT, atomic_write
from tools.flags import die, parse
from tools.outputs import check_output

OUT = os.path.join(ROOT, "data", "python.jsonl.gz")


@dataclass
class CorpusFlags:
    out: str = OUT               # where the corpus goes (the shipped file by default)
    overwrite: bool = False      # replace another gzip file at --out (the shipped file is rebuilt
                                 # without it: the same bytes)


def main(argv):
    flags = CorpusFlags(**parse(argv, CorpusFlags, __doc__))
    out = flags.out
    if not out:
        die("--out is empty; pass the corpus file to write, e.g. --out=python.jsonl.gz", 2)
    # a file of another kind (a checkpoint, the other corpus) is never replaced; a missing or read-only
    # directory is one line
    check_output("--out", out, "gzip",
                 overwrite=flags.overwrite or os.path.abspath(out) == os.path.abspath(OUT))
    if sys.version_info[:3] != (3, 11, 7):
        die(f"needs CPython 3.11.7 (this is {sys.version.split()[0]}); the corpus is "
                 f"pinned to that release")
    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(p for p in glob.glob(os.path.join(lib, "*.py"))
                   if not os.path.basename(p).startswith("_sysconfigdata_"))
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for p in files:
            with open(p, "rb") as f:
                text = f.read().decode("utf-8")
            gz.write((json.dumps({"title": f"Lib/{os.path.basename(p)}", "text": text}) + "\n").encode())
    with atomic_write(out) as tmp, open(tmp, "wb") as f:
        f.write(buf.getvalue())
    print(f"{len(files)} files from {lib} -> {out}: {len(buf.getvalue()):,} bytes, "
          f"sha256 {hashlib.sha256(buf.getvalue()).hexdigest()}")


if __name__ == "__main__":
    main(sys.argv[1:])
