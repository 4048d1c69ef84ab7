"""devtools/cpu_load.py: the load runs beside the command, ends by its bound, and the command's exit status is kept."""
from __future__ import annotations

import subprocess
import sys

import pytest

from devtools.cpu_load import main


def test_the_command_runs_under_a_bounded_load_and_keeps_its_exit_status():
    out = subprocess.run([sys.executable, "-m", "devtools.cpu_load", "--procs", "1", "--max-seconds", "0.5", "--",
                          sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(3)"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    took, loaded = (float(out.stderr.split(word)[1].split()[0]) for word in (" in ", " for "))
    assert loaded < took       # the load stopped at its bound, before the command ended


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--procs", "2"])
    assert e.value.code == 2 and "no command" in capsys.readouterr().err
