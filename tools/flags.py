"""
The one command-line parser of every nanoBitNet command, and its one error path.

Each command describes its flags as a @dataclass whose fields carry a default and a trailing
comment; parse() reads `--key=value` against the field types and `--help` prints every flag with its
default and that comment.
  booleans   true/false, 1/0, yes/no, on/off (any case); a bare --flag means --flag=true (any other
             flag given bare, --out_dir with no =value, is refused naming it)
  errors     one line "error: ..." on stderr naming the flag and the fix; exit 2 for a bad flag, 1
             for a failure while running (die); --help exits 0
  renamed    a flag that was renamed ({old: new}, given by the command) ends in one line naming its
             new name
  Ctrl-C     every command's first call is stop_on_ctrl_c(__name__): while its imports load, Ctrl-C
             stops it at once with no traceback; parse() makes Ctrl-C a KeyboardInterrupt again
Test: python -m pytest tests/test_flags.py tests/test_layout.py
"""

import dataclasses
import inspect
import os
import re
import signal
import sys

BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False,
            "no": False, "off": False}


def die(msg, code=1):
    """The one error line: `error: <what was wrong, and the fix>` on stderr, then exit (2: bad
    input). Under torchrun every rank may fail, so a rank other than 0 says which it is."""
    rank = int(os.environ.get("RANK", 0) or 0)
    print(f"error: {msg}" if rank == 0 else f"error: [rank {rank}] {msg}", file=sys.stderr)
    sys.exit(code)


def stop_on_ctrl_c(name):
    """An entry point's first call, stop_on_ctrl_c(__name__): while its imports load, Ctrl-C stops
    the program at once, with no traceback; parse() makes Ctrl-C a KeyboardInterrupt again. An
    imported module is left alone."""
    if name == "__main__":
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def to_bool(val):
    """A boolean flag's value: true/false, 1/0, yes/no, on/off in any case; ValueError otherwise."""
    try:
        return BOOLEANS[str(val).lower()]
    except KeyError:
        raise ValueError(f"{val!r} is not a boolean") from None


def field_comments(cls):
    """{field: its comment} from the class source (and its dataclass bases', a command's flags may
    come from several: train.py's, tools/config.py): the trailing comment on the field's line, plus
    the comment lines under it that continue it (indented well past the field; a comment at the
    field's indent is a heading)."""
    out = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_comments(base))
    return out


def _own_comments(cls):
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, last, indent = {}, None, 0
    for line in lines:
        m = re.match(r"(\s*)(\w+)\s*:[^#]*?#\s?(.*)$", line)
        if m and not line.lstrip().startswith("#"):
            last, indent = m.group(2), len(m.group(1))
            out[last] = m.group(3).strip()
        elif last and line.lstrip().startswith("#") and len(line) - len(line.lstrip()) > indent + 4:
            out[last] += " " + line.strip().lstrip("#").strip()
        else:
            last = None
    return out


def usage(cls, doc="", positional=None):
    """The --help text: the command's docstring, then one line per flag: --name=default
    description."""
    comments = field_comments(cls)
    rows = [(f"--{f.name}={_show(_default(f))}",
             comments.get(f.name, "")) for f in dataclasses.fields(cls)]
    width = min(max(len(a) for a, _ in rows), 34)
    lines = [doc.strip(), "", "flags (--key=value; booleans take true/false, 1/0, yes/no, on/off):"]
    if positional:
        lines.append(f"  {positional}")
    lines += [f"  {a:<{width}}  {c}".rstrip() for a, c in rows]
    return "\n".join(lines) + "\n"


def parse(argv, cls, doc="", convert=None, positional=None, renamed=None):
    """--key=value pairs checked against cls's fields; returns {key: typed value} of the flags
    given. convert: {key: fn(str) -> value} for flags with their own spelling (fn raises
    ValueError("expected ...")). positional: a description of plain (non-flag) arguments the command
    takes, e.g. "FILE ..."; then returns (flags, [arguments]); without it, a plain argument is an
    error. --help / -h print usage() and exit 0. renamed: {old name: new name} of flags that were
    renamed; an old name is refused with its new one."""
    # an entry point's while its imports loaded
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
        # Ctrl-C is KeyboardInterrupt again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    convert, renamed = convert or {}, renamed or {}
    flags, rest = {}, []
    for arg in argv:
        if arg in ("-h", "--help"):
            sys.stdout.write(usage(cls, doc, positional))
            sys.exit(0)
        if not arg.startswith("-") and positional:
            rest.append(arg)
            continue
        key, eq, val = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and key in renamed and key not in fields:
            die(f"--{key} is now --{renamed[key]}; pass --{renamed[key]}={val or '...'}", 2)
        if arg.startswith("--") and not eq and key in fields:
            # only a boolean may be bare: --out_dir is not --out_dir=true
            if _type(fields[key]) is not bool:
                example = _show(_default(fields[key])) or "..."
                die(f"--{key} needs a value, e.g. --{key}={example} (only a boolean flag may be "
                    "given bare, meaning true)", 2)
            eq, val = "=", "true"  # a bare --flag of a boolean means --flag=true
        if not arg.startswith("--") or not eq or key not in fields:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: "
                f"{', '.join(fields)} (--help describes each)", 2)
        typ = _type(fields[key])
        try:
            if key in convert:
                flags[key] = convert[key](val)
            elif typ is bool:
                flags[key] = to_bool(val)
            else:
                flags[key] = typ(val)
        except ValueError as e:
            if key in convert and str(e).startswith("expected"):
                die(f"--{key}={val}: {e}", 2)  # the converter's own words: "expected ..."
            what = "true or false (also 1/0, yes/no, on/off)" if typ is bool else \
                "an integer" if typ is int else "a number" if typ is float else typ.__name__
            die(f"--{key}={val}: expected {what}", 2)
    return (flags, rest) if positional else flags


def _type(f):
    names = {"int": int, "float": float, "str": str, "bool": bool}
    return names.get(f.type, str) if isinstance(f.type, str) else f.type


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else ""


def _show(v):
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str) and v != v.strip() or isinstance(v, str) and any(c in v for c in "\n\t"):
        return repr(v)  # a prompt of "\n" shows as '\n'
    return "" if v is None else str(v)
