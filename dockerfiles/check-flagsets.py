"""The flag-set rehearsal: one translation unit for every distinct set of compile flags, with the flags we export.

    python3 check-flagsets.py COMPILE_COMMANDS.json [--cflags FLAGS] [--cxxflags FLAGS] [--cudaflags FLAGS]
                              [--plan] [--timeout S] [--ninja BUILD_DIR]

COMPILE_COMMANDS.json is what CMake writes with CMAKE_EXPORT_COMPILE_COMMANDS=ON (torch configured at the pinned
version, or any sub-project of it, e.g. its third_party/fbgemm). Its entries are grouped by language (C, C++, CUDA,
from the source's suffix) and by their arguments less the source, the object and the dependency-file arguments: one
group is one flag set. For each set, its first entry is compiled again with the flags we export for its language
added where CMake puts CMAKE_<LANG>_FLAGS (right after the compiler), the object going to a scratch directory. The
first compiler error stops the run with the command that failed and the compiler's own lines: a flag that some
third-party target refuses (GCC: `switch '-mcpu=neoverse-n1' conflicts with '-march=armv8-a+sve2' switch`, under
that target's -Werror) shows in minutes, not hours into the compile. --plan lists the sets without compiling.

--ninja BUILD_DIR: the configure ran in the compile's own environment (our flags already in CMAKE_<LANG>_FLAGS), so
each set's entry is built by ninja as the real compile builds it: its object's target, after what the object needs
first (a configured torch includes headers that its codegen writes at build time: ATen/ops/*.h). The flags are then
not added: a set that lacks them (a target that drops CMAKE_<LANG>_FLAGS) is named in a note.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = {".c": "C", ".cc": "CXX", ".cp": "CXX", ".cpp": "CXX", ".cxx": "CXX", ".c++": "CXX", ".C": "CXX",
             ".cu": "CUDA"}
LAUNCHERS = {"ccache", "sccache", "distcc", "buildcache"}
# Arguments that name this entry's own files, not its flags: (argument, how many words it takes).
OWN_FILES = {"-o": 1, "-MF": 1, "-MT": 1, "-MQ": 1, "-c": 0, "-MD": 0, "-MMD": 0, "--compile": 0}
OUT = "{OUT}"                  # the object's place in a planned command, filled by the edge (run)
SHOWN = 40                     # compiler output lines kept in the log on failure


@dataclass(frozen=True)
class Entry:
    directory: str
    file: str
    arguments: tuple[str, ...]


@dataclass(frozen=True)
class FlagSet:
    language: str
    flags: tuple[str, ...]     # the entry's arguments less its own files (the grouping key)
    entries: int               # how many entries share these flags
    entry: Entry               # the one compiled
    command: tuple[str, ...]   # what is run, in entry.directory (OUT: the object)


def entries(text: str, where: str = "compile_commands.json") -> list[Entry]:
    """The entries of a compile_commands.json; ValueError (one line) for anything that is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: expected a non-empty list of compile commands")
    out = []
    for i, e in enumerate(data):
        if not isinstance(e, dict) or not isinstance(e.get("directory"), str) or not isinstance(e.get("file"), str):
            raise ValueError(f"{where}: entry {i} lacks its directory or file")
        if isinstance(e.get("arguments"), list) and e["arguments"] and all(isinstance(a, str) for a in e["arguments"]):
            args = tuple(e["arguments"])
        elif isinstance(e.get("command"), str) and e["command"].strip():
            try:
                args = tuple(shlex.split(e["command"]))
            except ValueError as err:
                raise ValueError(f"{where}: entry {i} ({e['file']}): its command does not split ({err})") from None
        else:
            raise ValueError(f"{where}: entry {i} ({e['file']}) has neither arguments nor a command")
        out.append(Entry(e["directory"], e["file"], args))
    return out


def language(entry: Entry) -> str | None:
    suffix = Path(entry.file).suffix
    return LANGUAGES.get(suffix, LANGUAGES.get(suffix.lower()))


def compiler_end(args: tuple[str, ...]) -> int:
    """Index just past the compiler (past a launcher such as ccache, which runs the compiler that follows it)."""
    i = 0
    while i < len(args) - 1 and Path(args[i]).name in LAUNCHERS:
        i += 1
    return i + 1


def _is_source(arg: str, entry: Entry) -> bool:
    return arg == entry.file or os.path.normpath(os.path.join(entry.directory, arg)) == os.path.normpath(
        os.path.join(entry.directory, entry.file))


def flags(entry: Entry) -> tuple[str, ...]:
    """The entry's arguments less the source, the object and the dependency-file arguments."""
    out, args, i = [], entry.arguments, 0
    while i < len(args):
        a = args[i]
        if a in OWN_FILES:
            i += 1 + OWN_FILES[a]
            continue
        if i > 0 and ((a.startswith("-o") and len(a) > 2) or (a[:3] in ("-MF", "-MT", "-MQ") and len(a) > 3)):
            i += 1             # the joined forms: -ofoo.o, -MFfoo.d
            continue
        if not _is_source(a, entry):
            out.append(a)
        i += 1
    return tuple(out)


def output(entry: Entry) -> str | None:
    """The entry's object, as its command names it (-o OBJ or -oOBJ), or None."""
    args = entry.arguments
    for i, a in enumerate(args[1:], 1):
        if a == "-o" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("-o") and len(a) > 2:
            return a[2:]
    return None


def ninja_target(entry: Entry, build_dir: str) -> str:
    """The ninja target that builds the entry's object: its path relative to the build directory (CMake's Ninja
    generator names objects so); ValueError (one line) when the entry names no object."""
    obj = output(entry)
    if obj is None:
        raise ValueError(f"{entry.file}: its command names no object (-o), so ninja cannot build it")
    return os.path.relpath(os.path.normpath(os.path.join(entry.directory, obj)), os.path.normpath(build_dir))


def plan(items: list[Entry], added: dict[str, list[str]],
         ninja: str | None = None) -> tuple[list[FlagSet], list[Entry]]:
    """The flag sets in first-seen order, each with the command that compiles its first entry with `added[language]`
    after the compiler (with `ninja`, a build directory: ninja's command that builds the entry's object there, nothing
    added); and the entries in no language of LANGUAGES (assembly and the like), not compiled."""
    groups: dict[tuple[str, tuple[str, ...]], list[Entry]] = {}
    other = []
    for e in items:
        lang = language(e)
        if lang is None:
            other.append(e)
            continue
        groups.setdefault((lang, flags(e)), []).append(e)
    sets = []
    for (lang, key), members in groups.items():
        first = members[0]
        if ninja is not None:
            command = ("ninja", "-C", ninja, ninja_target(first, ninja))
        else:
            at = compiler_end(key)
            command = (*key[:at], *added.get(lang, []), *key[at:], "-c", first.file, "-o", OUT)
        sets.append(FlagSet(lang, key, len(members), first, command))
    return sets, other


def summary(sets: list[FlagSet], other: list[Entry]) -> str:
    by = {lang: sum(1 for s in sets if s.language == lang) for lang in ("C", "CXX", "CUDA")}
    n = sum(s.entries for s in sets)
    return (f"{len(sets)} flag sets ({', '.join(f'{k} {v}' for k, v in by.items())}) over {n} entries"
            + (f"; {len(other)} entries in no language of ours, not compiled" if other else ""))


def run(s: FlagSet, out: Path, timeout: float) -> tuple[int, list[str], float]:
    """Compile one flag set's entry: its exit status, the compiler's output lines, the seconds it took."""
    cmd = [out.as_posix() if a == OUT else a for a in s.command]
    t = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=s.entry.directory, capture_output=True, text=True, timeout=timeout)
        code, lines = r.returncode, (r.stdout + r.stderr).splitlines()
    except FileNotFoundError as e:
        code, lines = 127, [f"{cmd[0]}: not found ({e.strerror})"]
    except subprocess.TimeoutExpired:
        code, lines = 124, [f"timed out after {timeout:.0f} s"]
    return code, lines, time.monotonic() - t


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="check-flagsets.py", description=__doc__.split("\n\n")[1])
    ap.add_argument("compile_commands", type=Path)
    ap.add_argument("--cflags", default="", help="what we export as CFLAGS (added to C entries)")
    ap.add_argument("--cxxflags", default="", help="what we export as CXXFLAGS (added to C++ entries)")
    ap.add_argument("--cudaflags", default="", help="what we export for nvcc (added to CUDA entries)")
    ap.add_argument("--plan", action="store_true", help="list the flag sets, compile nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one translation unit may take")
    ap.add_argument("--ninja", metavar="BUILD_DIR", help="build each set's object with ninja in BUILD_DIR, configured "
                    "with our flags (codegen first), instead of compiling it again with the flags added")
    a = ap.parse_args(argv)
    try:
        items = entries(a.compile_commands.read_text(), str(a.compile_commands))
        added = {"C": shlex.split(a.cflags), "CXX": shlex.split(a.cxxflags), "CUDA": shlex.split(a.cudaflags)}
        sets, other = plan(items, added, a.ninja)
    except OSError as e:
        sys.exit(f"check-flagsets: {a.compile_commands}: {e.strerror}")
    except ValueError as e:
        sys.exit(f"check-flagsets: {e}")
    if not sets:
        sys.exit(f"check-flagsets: {a.compile_commands}: no C, C++ or CUDA entry")
    print(f"check-flagsets: {a.compile_commands}: {summary(sets, other)}")
    how = "expected in the configured flags (ninja builds each set)" if a.ninja else "added"
    print(f"check-flagsets: {how}: " + "; ".join(f"{k} {' '.join(v) or '(nothing)'}" for k, v in added.items()))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flagsets-") as tmp:
        for i, s in enumerate(sets, 1):
            head = f"check-flagsets: [{i}/{len(sets)}] {s.language} ({s.entries} entries) {s.entry.file}"
            if a.plan:
                print(head, "|", shlex.join(s.command))
                continue
            code, lines, took = run(s, Path(tmp) / f"{i}.o", a.timeout)
            if code != 0:
                print(f"{head}: FAILED (exit {code}, {took:.1f} s), in {s.entry.directory}:")
                print(shlex.join(s.command).replace(OUT, str(Path(tmp) / f"{i}.o")))
                for line in lines[:SHOWN]:
                    print(line[:400])
                if len(lines) > SHOWN:
                    print(f"… {len(lines) - SHOWN} more lines")
                error = next((ln for ln in lines if "error" in ln), lines[0] if lines else "no message")
                print(f"check-flagsets: FAILED at flag set {i} of {len(sets)} after {time.monotonic() - started:.1f} s: "
                      f"{error.strip()[:300]}", file=sys.stderr)
                return 1
            lacks = [w for w in added.get(s.language, []) if w not in s.flags] if a.ninja else []
            note = f"; note: configured without {' '.join(lacks)}" if lacks else ""
            print(f"{head}: ok ({took:.1f} s{note})", flush=True)
    if not a.plan:
        print(f"check-flagsets: every flag set compiled with the exported flags "
              f"({len(sets)} translation units, {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
