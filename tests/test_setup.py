"""``make setup``: where torch comes from, a torch present is never replaced, no index host named.

The set-up runs against a stand-in virtual environment whose ``python`` records every call and
plays pip: torch importable or not, a local CPU wheel on pip's find-links or not, a CUDA driver
(``nvidia-smi``) or not. Nothing is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"  # what pip would find locally

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

# Plays python and pip: "-c" code that imports torch, or prints its installed version, succeeds
# once torch is "installed"; "pip download" finds a CPU wheel only with LOCAL_WHEEL set; "pip
# install" of anything naming torch "installs" it.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
here="$(cd "$(dirname "$0")" && pwd)"
if [ "$1" = "-c" ]; then
  case "$2" in
    *"import torch"*)
      [ -f "$here/torch-installed" ];;
    *"version('torch')"*)
      [ -f "$here/torch-installed" ] && echo "$FAKE_TORCH_VERSION";;
  esac
  exit  # the status of the case's last command
fi
if [ "$1 $2 $3" = "-m pip download" ]; then
  [ -n "$LOCAL_WHEEL" ] || exit 1
  dest=""; previous=""
  for a in "$@"; do [ "$previous" = "--dest" ] && dest="$a"; previous="$a"; done
  mkdir -p "$dest" && touch "$dest/$WHEEL"
  exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  case "$*" in *torch*) touch "$here/torch-installed";; esac
  exit 0
fi
exit 0
"""


def make_setup(tmp_path: Path, *, torch: bool, local_wheel: bool, cuda: bool, **variables):
    """Runs ``make setup`` against the stand-in; returns the python calls and make's output."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    if torch:
        (venv / "bin" / "torch-installed").touch()
    tools = tmp_path / "tools"  # an nvidia-smi that finds a GPU, or one that finds none
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {0 if cuda else 9}\n")
    smi.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {
        "PATH": f"{tools}:/usr/bin:/bin",
        "CALLS": str(calls),
        "LOCAL_WHEEL": "1" if local_wheel else "",
        "FAKE_TORCH_VERSION": "2.13.0+cpu",
        "WHEEL": WHEEL,
    }
    args = ["make", "--no-print-directory", "-C", str(ROOT), "setup", f"VENV={venv}"]
    args += [f"{key}={value}" for key, value in variables.items()]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (venv / ".installed").exists()
    return calls.read_text().splitlines(), done.stdout


def pip_installs(calls: list[str]) -> list[str]:
    return [c.removeprefix("-m pip install ") for c in calls if c.startswith("-m pip install")]


PROJECT = "-e .[dev] torch==2.13.0+cpu"  # the project, with the torch present pinned


def test_an_importable_torch_is_kept(tmp_path):
    calls, _ = make_setup(tmp_path, torch=True, local_wheel=True, cuda=True)
    assert pip_installs(calls) == [PROJECT]
    assert not any("pip download" in c for c in calls)


def test_without_cuda_a_local_cpu_wheel_is_installed(tmp_path):
    calls, out = make_setup(tmp_path, torch=False, local_wheel=True, cuda=False)
    wheel = tmp_path / "venv" / ".torch-wheel" / WHEEL
    assert pip_installs(calls) == [str(wheel), PROJECT]
    assert "installing the local CPU wheel" in out
    assert not wheel.parent.exists()  # the probe folder is removed


def test_without_cuda_or_wheel_torch_alone_comes_from_the_cpu_index_given(tmp_path):
    calls, _ = make_setup(
        tmp_path, torch=False, local_wheel=False, cuda=False, TORCH_CPU_INDEX="file:///cpu-wheels"
    )
    assert pip_installs(calls) == [
        "--no-deps torch==2.13.0 --index-url file:///cpu-wheels",
        PROJECT,  # torch's own dependencies come from pip's configured index
    ]


def test_without_cuda_wheel_or_cpu_index_torch_comes_from_pips_index(tmp_path):
    calls, out = make_setup(tmp_path, torch=False, local_wheel=False, cuda=False)
    assert pip_installs(calls) == ["torch==2.13.0", PROJECT]
    assert "make setup TORCH_CPU_INDEX=<url>" in out


def test_with_a_cuda_driver_the_cuda_build_comes_from_pips_index(tmp_path):
    calls, out = make_setup(tmp_path, torch=False, local_wheel=True, cuda=True)
    assert pip_installs(calls) == ["torch==2.13.0", PROJECT]
    assert "CUDA driver found" in out


# Hosts of package indexes, written in pieces so that this file does not name them either.
INDEX_HOSTS = [
    "pypi" + ".org",
    "pythonhosted" + ".org",
    "download" + ".pytorch.org",
    "anaconda" + ".org",
]
INDEX_OPTIONS = re.compile(r"--(extra-)?index-url[ =]+https?://")


def repository_files() -> list[Path]:
    """The repository's files: git's list where there is one, else every file but built ones."""
    done = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode == 0 and done.stdout:
        return [ROOT / name for name in done.stdout.split("\0") if name]
    skip = {".git", ".venv", "build", "dist", "runs", "__pycache__"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_no_file_names_a_package_index_host():
    named = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # weights and other binary files
        for host in INDEX_HOSTS:
            if host in text.lower():
                named.append(f"{path.relative_to(ROOT)}: {host}")
        if INDEX_OPTIONS.search(text):
            named.append(f"{path.relative_to(ROOT)}: an index URL option")
    assert not named, named
    assert any(p.name == "Makefile" for p in repository_files())
