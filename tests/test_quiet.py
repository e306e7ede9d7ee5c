"""The command's screen: the library's own warnings in one line without a file path, anyone
else's as Python writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lightning_troll.callbacks
from lightning_troll.cli.quiet import OWN_CODE, own_warning_format

ROOT = Path(__file__).resolve().parents[1]


def test_the_librarys_warnings_are_one_line_and_others_keep_their_place():
    ours = Path(lightning_troll.callbacks.__file__).parent / "old_policy.py"
    line = own_warning_format(UserWarning("a lag"), UserWarning, str(ours), 12)
    assert line == "lightning-troll: warning: a lag\n"
    module = OWN_CODE[0] / "training" / "module.py"
    assert own_warning_format("x", UserWarning, str(module), 1) == "lightning-troll: warning: x\n"
    theirs = own_warning_format("y", DeprecationWarning, "/elsewhere/lib.py", 7, line="")
    assert theirs == "/elsewhere/lib.py:7: DeprecationWarning: y\n"


@pytest.mark.slow
def test_the_command_prints_its_warning_without_a_path(tmp_path):
    """A run whose every step is on-policy warns in one line on stderr, no path of the
    library's code in front."""
    done = subprocess.run(
        [sys.executable, "-c", "from lightning_troll.cli import main; main()", "fit",
         "--config", str(ROOT / "configs" / "tinymath.yaml"), "--trainer.max_steps", "1",
         "--data.batch_size", "4", "--model.optimization.minibatch_size", "null",
         "--data.num_val", "4", "--trainer.default_root_dir", str(tmp_path),
         "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    told = [
        line for line in done.stderr.splitlines() if "every optimiser step is on-policy" in line
    ]
    assert len(told) == 1 and told[0].startswith("lightning-troll: warning: every optimiser")
    assert str(OWN_CODE[0]) not in done.stderr and "UserWarning" not in told[0]
