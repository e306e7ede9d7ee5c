"""The distribution: callbacks/ is installed as lightning_troll.callbacks, editable and wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import lightning_troll
import lightning_troll.callbacks

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_callbacks_folder():
    assert Path(lightning_troll.callbacks.__file__) == ROOT / "callbacks" / "__init__.py"
    assert Path(lightning_troll.__file__) == ROOT / "lightning_troll" / "__init__.py"


def test_maths_modules_do_not_import_lightning_or_transformers():
    code = (
        "import sys, lightning_troll.trust_region.projection, lightning_troll.objectives, "
        "lightning_troll.objectives.advantages; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    # Build from a copy so that build/ and *.egg-info never land in the working tree.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "runs")

    def ignore(folder: str, names: list[str]) -> set[str]:
        # and the downloads at the top (SmolLM2 is 0.6 GB; the package's own models/ stays)
        top = {"models", "gpu-wheels"} if Path(folder) == ROOT else set()
        return set(skip(folder, names)) | (top & set(names))

    shutil.copytree(ROOT, src, ignore=ignore)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("lightning_troll-*.whl")
    import lightning_troll

    # the version is written once (lightning_troll.__version__) and is the changelog's newest
    assert wheel.name.startswith(f"lightning_troll-{lightning_troll.__version__}-")
    newest = (ROOT / "CHANGELOG.md").read_text().split("\n## ", 1)[1].split("\n", 1)[0]
    assert newest == lightning_troll.__version__
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_troll/callbacks/__init__.py" in names
    for layer in (
        "trust_region",
        "objectives",
        "models",
        "tasks",
        "tasks/data",
        "tasks/rewards",
        "tasks/environments",
        "engines",
        "rollouts",
        "training",
        "cli",
    ):
        assert f"lightning_troll/{layer}/__init__.py" in names, layer
    assert "lightning_troll/trust_region/projection.py" in names
    for asset in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
        assert f"lightning_troll/models/assets/tinymath/{asset}" in names, asset
    assert not [n for n in names if n.startswith("callbacks/")], "no top-level callbacks package"
    assert not [n for n in names if n.startswith("tests/")]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # The dependencies (torch, ...) come from this environment's site-packages through a .pth
    # file, which adds the folder without running its .pth files: the editable finder of the
    # development install stays inactive, so only the wheel provides lightning_troll.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib.util, lightning_troll, lightning_troll.callbacks as c; "
        "from lightning_troll.trust_region.projection import TrustRegionProjection; "
        "import lightning_troll.engines.hf, lightning_troll.tasks.data.datamodule; "
        "assert importlib.util.find_spec('lightning_troll.projection') is None; "
        "from lightning_troll.models.loading import load_policy; load_policy('tinymath'); "
        "print(lightning_troll.__file__); print(c.__file__); "
        "print(importlib.util.find_spec('callbacks'))"
    )
    done = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    package, callbacks, top_level = done.stdout.split()
    assert package.startswith(site) and callbacks.startswith(site)
    assert callbacks.endswith("lightning_troll/callbacks/__init__.py")
    assert top_level == "None"
