"""A compile_commands fixture for the flag-set rehearsal in CI: one entry per flag set of a real configure, flags and
file names only (no source).

    python -m devtools.flagset_fixture COMPILE_COMMANDS.json SRC_ROOT OUT.json

Each set's first entry is kept (check-flagsets.py's grouping) with the source root written `{src}`, the build
directory `{build}`, the C and C++ compilers `{cc}` and `{cxx}`, and include directories dropped (paths into sources
that are not committed; a flag conflict does not depend on them). `entries` records how many entries the set had.
tests/test_flagsets.py writes an empty translation unit at each file name and compiles every set with the profile's
flags: the compiler refuses a conflicting pair whatever the source.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "dockerfiles" / "check-flagsets.py"
INCLUDES = {"-I": 1, "-isystem": 1, "-iquote": 1}


def _tool():
    spec = importlib.util.spec_from_file_location("check_flagsets", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def derive(text: str, src: str) -> list[dict]:
    cf = _tool()
    sets, _ = cf.plan(cf.entries(text), {})
    out = []
    for s in sets:
        e = s.entry
        words, i = [], 0
        compiler = "{cxx}" if s.language == "CXX" else "{cc}"
        args = [compiler, *s.flags[cf.compiler_end(s.flags):]]
        while i < len(args):
            a = args[i]
            if a in INCLUDES:
                i += 1 + INCLUDES[a]
                continue
            if a.startswith(("-I", "-isystem")) and a not in INCLUDES:
                i += 1
                continue
            words.append(a.replace(src, "{src}").replace(e.directory, "{build}"))
            i += 1
        if s.language == "CUDA":
            raise ValueError(f"{e.file}: a CUDA set; this fixture is for host compilers only")
        file = e.file.replace(src, "{src}")
        obj = "{build}/" + Path(file).name + ".o"
        out.append({"directory": "{build}", "file": file, "arguments": [*words, "-o", obj, "-c", file],
                    "entries": s.entries})
    return out


def main(argv: list[str]) -> int:
    cc, src, dest = argv
    Path(dest).write_text(json.dumps(derive(Path(cc).read_text(), src.rstrip("/")), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
