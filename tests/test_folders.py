"""Model folders swapped in whole: a move that fails puts the old folder back."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_troll.models import gguf
from lightning_troll.models.folders import replace_folder


def _folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_text(text)
    return path


def test_replace_folder_swaps_and_removes_the_old_one(tmp_path):
    target = _folder(tmp_path / "out", "old")
    replace_folder(target, _folder(tmp_path / "new", "new"))
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_folder_puts_the_old_folder_back_when_the_move_fails(tmp_path, monkeypatch):
    target = _folder(tmp_path / "out", "old")
    staging = _folder(tmp_path / "new", "new")
    real = Path.rename

    def rename(self, to):
        if self == staging:
            raise OSError(28, "No space left on device")
        return real(self, to)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        replace_folder(target, staging)
    assert (target / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]


def test_replace_folder_clears_an_aside_copy_a_killed_swap_left(tmp_path):
    target = _folder(tmp_path / "out", "old")
    _folder(tmp_path / "new.old", "stale")
    replace_folder(target, _folder(tmp_path / "new", "new"))
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


class _Saves:
    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, folder) -> None:
        (Path(folder) / self.name).write_text("converted")


def test_convert_gguf_keeps_the_old_folder_when_the_swap_fails(tmp_path, monkeypatch):
    """The conversion's folder is swapped in: a move that fails leaves the old model whole."""
    target = _folder(tmp_path / "out", "old")
    monkeypatch.setattr(gguf, "load_gguf_tokenizer", lambda path: _Saves("tokenizer.json"))
    monkeypatch.setattr(gguf, "load_gguf_policy", lambda path, dtype: _Saves("config.json"))
    real = Path.rename

    def rename(self, to):
        if self.name == "out.partial":
            raise OSError(28, "No space left on device")
        return real(self, to)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        gguf.convert_gguf(tmp_path / "x.gguf", target, overwrite=True)
    assert (target / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.setattr(Path, "rename", real)
    gguf.convert_gguf(tmp_path / "x.gguf", target, overwrite=True, card="# card")
    assert sorted(p.name for p in target.iterdir()) == [
        "README.md",
        "config.json",
        "tokenizer.json",
    ]


def test_replace_folder_sets_a_file_aside_where_it_is_told(tmp_path):
    """A checkpoint's swap names its own aside path, which resume looks for; what stood at the
    target (here a single-file checkpoint of the same name) is removed once the folder is in."""
    target = tmp_path / "last.ckpt"
    target.write_text("one file")
    aside = tmp_path / ".last.ckpt.old"
    aside.mkdir()  # a swap cut short left it: the target is whole, this goes first
    replace_folder(target, _folder(tmp_path / "new", "new"), aside)
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
