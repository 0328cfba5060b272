"""``./dev.sh``'s set-up: what each task installs, and that every install is announced.

Each case runs a copy of ``dev.sh`` next to a stand-in ``.venv`` whose ``python`` records
its calls instead of running them: ``python -c 'import X'`` succeeds only for the modules
named in ``FAKE_PRESENT``, ``python -m pip install ...`` succeeds (an editable install
creates the ``kdn-compile`` console script), and any other call prints its arguments.
Nothing is downloaded or installed.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = r'''#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = -c ]; then
    for module in $FAKE_PRESENT; do
        case "$2" in *"$module"*) exit 0 ;; esac
    done
    exit 1
fi
if [ "$1 $2 $3" = "-m pip install" ] && [[ " $* " == *" -e "* ]]; then
    printf '#!/bin/sh\necho kdn-compile "$@"\n' > "$(dirname "$0")/kdn-compile"
    chmod +x "$(dirname "$0")/kdn-compile"
fi
[ "$1 $2" = "-m pip" ] || echo "python $*"
'''

BASE = {"setuptools", "tqdm", "numpy"}
TOOLS = {"test": {"pytest", "expecttest", "transformers", "hypothesis", "pytest-xdist"},
         "docs": {"sphinx", "myst-parser"}}
EVERYTHING = "torch triton setuptools tqdm numpy pytest expecttest transformers hypothesis xdist " \
             "sphinx myst_parser"


def dev_sh(tmp_path: Path, *args: str, present: str, installed: bool = False):
    """Run ``dev.sh ARGS`` on a stand-in ``.venv``; returns (completed process, pip installs)."""
    shutil.copy(ROOT / "dev.sh", tmp_path / "dev.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    script = bin_dir / "kdn-compile"
    if installed and not script.exists():
        script.write_text('#!/bin/sh\necho kdn-compile "$@"\n')
        script.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    done = subprocess.run(["bash", str(tmp_path / "dev.sh"), *args], cwd=tmp_path,
                          env=dict(env, FAKE_LOG=str(log), FAKE_PRESENT=present),
                          capture_output=True, text=True, timeout=120)
    installs = [line.split()[-1] for line in log.read_text().splitlines()
                if line.startswith("-m pip install")]
    return done, installs


def names(pins) -> set[str]:
    return {pin.split("==")[0] for pin in pins if pin != "."}


@pytest.mark.parametrize("task", ["demo", "check", "test", "docs"])
def test_each_task_installs_its_own_tools_and_says_so(tmp_path, task):
    done, installs = dev_sh(tmp_path, task, present="")
    assert done.returncode == 0, done.stderr
    expected = BASE | TOOLS.get(task, set()) | {"torch"}
    if platform.system() == "Linux":
        expected.add("triton")
    assert names(installs) == expected, installs
    assert installs[-1] == ".", "the package itself comes last, editable"
    # one line before each install, naming it
    announced = re.findall(r"^dev\.sh: installing (\S+) ", done.stderr, re.M)
    assert names(announced) == expected | {"kdn_compile"}, done.stderr
    assert len(announced) == len(installs), done.stderr
    assert "dev.sh: installing kdn_compile from this checkout (editable)" in done.stderr


def test_a_second_run_installs_nothing_and_runs_the_task(tmp_path):
    done, installs = dev_sh(tmp_path, "demo", "--steps", "2", present=EVERYTHING,
                            installed=True)
    assert done.returncode == 0, done.stderr
    assert installs == [] and "installing" not in done.stderr, done.stderr
    assert done.stdout == "kdn-compile demo --steps 2\n"
    done, _ = dev_sh(tmp_path, "test", "-q", present=EVERYTHING, installed=True)
    assert done.stdout == "python -m pytest tests -q\n"


def test_test_paths_given_replace_the_whole_suite(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    for args, expected in [
        (("-q", "tests/test_x.py"), "python -m pytest -q tests/test_x.py\n"),
        (("tests/test_x.py::test_a",), "python -m pytest tests/test_x.py::test_a\n"),
        (("-k", "gdn"), "python -m pytest tests -k gdn\n"),
    ]:
        done, _ = dev_sh(tmp_path, "test", *args, present=EVERYTHING, installed=True)
        assert done.stdout == expected, (args, done.stdout, done.stderr)


def test_the_transformers_pin_is_the_test_extra_pin():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    pinned = next(p for p in extra if p.startswith("transformers=="))
    test_pins = re.search(r"^TEST_PINS=\((.*?)\)", (ROOT / "dev.sh").read_text(), re.M | re.S)[1]
    assert f'"{pinned}"' in test_pins.split(), (pinned, test_pins)
