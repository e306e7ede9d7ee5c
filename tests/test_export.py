"""lightning-troll export: a fit checkpoint's policy as a Hugging Face model folder."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_troll.cli.command import main as cli_main
from lightning_troll.cli.command import run as cli_run
from lightning_troll.cli.export import MARKER
from lightning_troll.training.module import TrollModule

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # short fits


def fit(folder: Path, model_dir: Path, *extra: str) -> Path:
    """Two rollouts of TinyMath on ``model_dir`` at a learning rate that moves every weight, with
    a reward that varies (an untrained model never answers right, and with no advantage no
    weight moves); the path of its last.ckpt."""
    cli_run(
        [
            "fit", "--config", str(ROOT / "configs" / "tinymath.yaml"),
            "--model.model", str(model_dir),
            "--model.optimizer.init_args.lr", "1e-2",
            "--model.rewards", '{"tests.reward_helpers:length_reward": 1.0}',
            "--trainer.max_steps", "4",
            "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "false",
            "--trainer.default_root_dir", str(folder),
            "--data.batch_size", "2",
            "--data.num_train", "16",
            "--model.optimization.minibatch_size", "8",
            "--checkpoint.dirpath", str(folder),
            *extra,
        ]
    )  # fmt: skip
    return folder / "last.ckpt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir) -> Path:
    return fit(tmp_path_factory.mktemp("export_fit"), tiny_model_dir)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])


def test_the_exported_folder_is_the_trained_policy(checkpoint, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    cli_main(["export", "--ckpt_path", str(checkpoint), "--output_dir", str(out)])
    assert f"to {out}" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(out)
    trained = TrollModule.load_from_checkpoint(checkpoint).policy
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert exported.state_dict().keys() == trained.state_dict().keys()
    for name, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    moved = max((exported.state_dict()[n] - w).abs().max() for n, w in base.state_dict().items())
    assert moved > 1e-3  # the fit trained it: this is not the base model
    torch.testing.assert_close(logits(exported, IDS), logits(trained, IDS), rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # no staging folder left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not the staging folder's 0700


def test_an_existing_folder_is_kept_and_overwrite_replaces_only_an_export(
    checkpoint, tmp_path, capsys
):
    """A folder with a file of one's own is refused, with or without --overwrite, and kept; an
    earlier export (its marker lists what it wrote) is replaced by --overwrite."""
    out = tmp_path / "exported"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    args = ["export", "--ckpt_path", str(checkpoint), "--output_dir", str(out)]
    for extra, message in (([], "exists and is not empty"), (["--overwrite"], "no export wrote")):
        with pytest.raises(SystemExit) as stop:
            cli_main([*args, *extra])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--output_dir" in err and message in err
        assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    cli_main(args)
    marker = json.loads((out / MARKER).read_text())
    assert "config.json" in marker["files"] and marker["ckpt_path"] == str(checkpoint.resolve())
    (out / "config.json").write_text("{}")  # an earlier export, edited: still the export's file
    cli_main([*args, "--overwrite"])
    assert json.loads((out / "config.json").read_text())["vocab_size"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def test_export_into_the_checkpoints_own_folder_deletes_nothing(checkpoint, tmp_path, capsys):
    """--overwrite into the folder that holds the checkpoint (and a run's logs): refused in one
    line, the checkpoint byte for byte as it was."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = run / "last.ckpt"
    ckpt.write_bytes(checkpoint.read_bytes())
    (run / "metrics.csv").write_text("step\n0\n")
    with pytest.raises(SystemExit) as stop:
        cli_main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(run), "--overwrite"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "holds the checkpoint being exported" in err and err.count("\n") == 1
    assert ckpt.read_bytes() == checkpoint.read_bytes()
    assert sorted(p.name for p in run.iterdir()) == ["last.ckpt", "metrics.csv"]


def test_export_through_a_symbolic_link_writes_where_it_points(checkpoint, tmp_path, capsys):
    """An ``--output_dir`` that is a link to an earlier export (a model folder on another disk,
    say): --overwrite writes the new model where the link points, the link stays and names it,
    and nothing is left beside either."""
    disk, here = tmp_path / "disk", tmp_path / "here"
    disk.mkdir(), here.mkdir()
    target = disk / "model"
    args = ["export", "--ckpt_path", str(checkpoint)]
    cli_main([*args, "--output_dir", str(target)])
    (target / "config.json").write_text("{}")  # the earlier export, edited
    link = here / "model"
    link.symlink_to(target, target_is_directory=True)
    cli_main([*args, "--output_dir", str(link), "--overwrite"])
    assert f"to {link}" in capsys.readouterr().out
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert json.loads((target / "config.json").read_text())["vocab_size"] > 0
    assert [p.name for p in here.iterdir()] == ["model"]
    assert [p.name for p in disk.iterdir()] == ["model"]


def test_export_inside_a_sharded_checkpoints_folder_is_refused(tmp_path, capsys):
    """The run replaces a sharded checkpoint's folder whole at its next save, so an export
    written inside it would be deleted: refused in one line, before the checkpoint is read."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    with pytest.raises(SystemExit) as stop:
        cli_main(["export", "--ckpt_path", str(folder), "--output_dir", str(folder / "model")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "lies inside the sharded checkpoint's folder" in err and err.count("\n") == 1
    assert list(folder.iterdir()) == []


def test_export_needs_neither_the_reward_nor_the_engine(checkpoint, tmp_path, capsys):
    """A checkpoint whose reward and tool modules are nowhere to be imported (renamed since) and
    whose engine is vLLM (not installed here) exports its policy all the same."""
    stored = torch.load(checkpoint, weights_only=False)
    stored["hyper_parameters"]["rewards"] = {"nowhere_to_be_found:reward": 1.0}
    stored["hyper_parameters"]["reward_options"] = {"workers": 2}
    stored["hyper_parameters"]["reward_workers"] = 2  # the flat key a checkpoint held before
    stored["hyper_parameters"].update(rollout_engine="vllm", episodes={"tools": ["tl2:add"]})
    moved = tmp_path / "moved.ckpt"
    torch.save(stored, moved)
    out = tmp_path / "exported"
    cli_main(["export", "--ckpt_path", str(moved), "--output_dir", str(out)])
    exported = AutoModelForCausalLM.from_pretrained(out)
    trained = TrollModule.load_from_checkpoint(checkpoint).policy
    for name, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--adapters_only"], "--adapters_only: the checkpoint"),
        (["--ckpt_path", "gone.ckpt"], "--ckpt_path 'gone.ckpt': no such file"),
        (
            ["--dtype", "int8"],
            "argument --dtype: invalid choice: 'int8' (choose from 'float32', 'bfloat16'",
        ),
        (
            ["--adapters_only", "--dtype", "float16"],
            "--dtype float16 with --adapters_only: the adapters are written as they trained",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    checkpoint, tmp_path, capsys, extra, message
):
    out = tmp_path / "exported"
    args = ["export", "--ckpt_path", str(checkpoint), "--output_dir", str(out), *extra]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    with pytest.raises(SystemExit):
        cli_main(["export", "--ckpt_path", str(tmp_path / "notes"), "--output_dir", "x"])
    assert (
        "is a folder but not a whole sharded checkpoint (it lacks '.metadata', 'meta.pt'"
        in capsys.readouterr().err
    )


def test_lora_exports_merged_or_as_adapters(tmp_path, tiny_model_dir):
    peft = pytest.importorskip("peft")
    ckpt = fit(tmp_path / "fit", tiny_model_dir, "--model.lora.r", "4")
    trained = TrollModule.load_from_checkpoint(ckpt).policy
    expected = logits(trained, IDS)
    base_logits = logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), IDS)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapters changed the policy

    merged = tmp_path / "merged"
    cli_main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(merged)])
    assert not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora_" in name for name in plain.state_dict())
    torch.testing.assert_close(logits(plain, IDS), expected, rtol=1e-5, atol=1e-5)

    adapters = tmp_path / "adapters"
    cli_main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(adapters), "--adapters_only"])
    assert (adapters / "adapter_config.json").is_file() and not (adapters / "snapshot").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = peft.PeftModel.from_pretrained(base, adapters)
    torch.testing.assert_close(logits(loaded, IDS), expected, rtol=1e-5, atol=1e-5)


def bf16_lora(tiny_model_dir: Path, scale: float):
    """The tiny model in bfloat16 with rank-4 adapters whose B matrices are ``scale`` times a
    standard normal sample: the delta weight is about ``scale`` times the base weights' size."""
    from lightning_troll.models.lora import LoraConfig, apply_lora

    pytest.importorskip("peft")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    policy = apply_lora(base, LoraConfig(r=4))
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(scale * torch.randn_like(weight))
    return policy


def test_a_small_lora_update_on_a_bfloat16_base_is_merged_in_float32(tiny_model_dir, capsys):
    """An update of about 1e-5 of the base weights' size (0.02) is far below bfloat16's rounding
    step there (2**-13, about 1.2e-4): rounding the merge to bfloat16 gives back the base weight
    nearly everywhere and so loses most of the update, so ``--dtype auto`` merges
    and writes float32, whose logits are the adapted policy's in float32; ``--dtype bfloat16``
    writes bfloat16 and warns; an update far above the step stays in bfloat16."""
    from lightning_troll.cli.export import ROUNDING_LIMIT, _merge, rounding_loss

    small = bf16_lora(tiny_model_dir, 1e-5)
    assert rounding_loss(small, torch.bfloat16) > 0.5
    assert rounding_loss(small, torch.float32) == 0.0
    expected = logits(small.float(), IDS)
    base_logits = logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), IDS)
    assert (expected - base_logits).abs().max() > 1e-6  # the adapters move the float32 logits
    merged = _merge(bf16_lora(tiny_model_dir, 1e-5), "auto")
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert "lightning-troll: rounding the merged weights to bfloat16 changes" in (
        capsys.readouterr().err
    )
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)

    rounded = _merge(bf16_lora(tiny_model_dir, 1e-5), "bfloat16")
    assert {p.dtype for p in rounded.parameters()} == {torch.bfloat16}
    assert "warning: --dtype bfloat16: rounding the merged weights" in capsys.readouterr().err

    large = bf16_lora(tiny_model_dir, 1.0)
    assert rounding_loss(large, torch.bfloat16) < ROUNDING_LIMIT
    kept = _merge(large, "auto")
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}
    assert "lightning-troll" not in capsys.readouterr().err


def test_a_merge_written_in_another_dtype_than_the_bases_is_rounded_once():
    """A bfloat16 base exported with ``--dtype float16``: the merge is computed in float32 and
    rounded to float16 once, the rounding the check measures. Merged in bfloat16 first (before),
    it kept bfloat16's coarser rounding of the update, which the float16 check did not see."""
    from lightning_troll.cli.export import _adapted_layers, _merge
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.lora import LoraConfig, apply_lora

    pytest.importorskip("peft")
    torch.manual_seed(0)
    base = tiny_causal_lm(20, hidden_size=16, seed=0).to(torch.bfloat16)
    policy = apply_lora(base, LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(0.05 * torch.randn_like(weight))
    expected = {}
    for i, layer in enumerate(_adapted_layers(policy)):
        exact = layer.get_base_layer().weight.float() + layer.get_delta_weight("default").float()
        expected[f"model.layers.{i}.self_attn.q_proj.weight"] = exact.to(torch.float16)
    merged = dict(_merge(policy, "float16").named_parameters())
    assert len(expected) == 2
    for name, weight in expected.items():
        assert merged[name].dtype == torch.float16 and torch.equal(merged[name], weight), name


def _sharded_folder(path: Path) -> Path:
    """What check_checkpoint_file asks of a sharded checkpoint's folder (not readable shards)."""
    path.mkdir()
    for name in (".metadata", "meta.pt", "__0_0.distcp"):
        (path / name).write_bytes(b"x")
    return path


def _swapping_loader(folder: Path, swaps: int, monkeypatch) -> list[Path]:
    """A loader of sharded checkpoints whose first ``swaps`` reads each see the run swap a new
    folder in (as save_folder_checkpoint does: the old one aside, the new one renamed in, the old
    one removed). Returns the list of folders read, by the inode each read saw."""
    import shutil

    import lightning.fabric.utilities.load as load

    reads = []

    def read(path):
        reads.append(os.stat(path).st_ino)
        if len(reads) <= swaps:
            fresh = _sharded_folder(folder.with_name(f"new{len(reads)}"))
            folder.rename(folder.with_name("aside"))
            fresh.rename(folder)
            shutil.rmtree(folder.with_name("aside"))
            return {"read": "mixed"}
        return {"read": "whole"}

    monkeypatch.setattr(load, "_load_distributed_checkpoint", read)
    return reads


def test_a_sharded_checkpoint_swapped_during_the_read_is_read_again(tmp_path, monkeypatch):
    """The run saved while the export read its folder: the shards could mix two saves, so the
    new folder is read again, whole."""
    from lightning_troll.cli.export import read_checkpoint

    folder = _sharded_folder(tmp_path / "last.ckpt")
    reads = _swapping_loader(folder, 1, monkeypatch)
    assert read_checkpoint(folder) == {"read": "whole"}
    assert len(reads) == 2 and reads[0] != reads[1]


def test_a_folder_swapped_at_every_read_is_refused_in_one_line(tmp_path, monkeypatch):
    from lightning_troll.cli.export import FOLDER_READS, read_checkpoint
    from lightning_troll.training.checkpoints import CheckpointError

    folder = _sharded_folder(tmp_path / "last.ckpt")
    reads = _swapping_loader(folder, FOLDER_READS, monkeypatch)
    with pytest.raises(CheckpointError, match=r"replaced this folder while it was read, 3 times"):
        read_checkpoint(folder)
    assert len(reads) == FOLDER_READS == 3


def test_a_read_that_fails_without_a_swap_is_not_retried(tmp_path, monkeypatch):
    import lightning.fabric.utilities.load as load

    from lightning_troll.cli.export import read_checkpoint

    folder = _sharded_folder(tmp_path / "last.ckpt")
    calls = []

    def broken(path):
        calls.append(path)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(load, "_load_distributed_checkpoint", broken)
    with pytest.raises(OSError, match="Input/output error"):
        read_checkpoint(folder)
    assert len(calls) == 1


def test_a_tied_head_under_an_embedding_adapter_is_exported_untied(tmp_path):
    """LoRA on the embedding of a tied model: the trained policy's output layer is the
    embedding's base weight. Merging moved the tied head with the embedding (before: other
    logits); the merge is written untied, and the saved folder computes the policy's logits."""
    from lightning_troll.cli.export import _merge
    from tests.test_snapshots import embedding_lora_policy

    pytest.importorskip("peft")
    policy = embedding_lora_policy()
    expected = logits(policy, IDS)
    merged = _merge(policy, "auto")
    assert merged.config.tie_word_embeddings is False
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(loaded, IDS), expected, rtol=1e-5, atol=1e-5)
