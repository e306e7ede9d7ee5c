"""The ``lightning-troll`` command: LightningCLI over TrollModule and PromptDataModule.

    lightning-troll fit --config configs/tinymath.yaml
    lightning-troll fit --config configs/tinymath.yaml --model.objective clip
    lightning-troll fit --help

The rollout callback, the snapshot refresh and both monitors are always present; their options
are the top-level keys ``rollout``, ``old_policy``, ``trust_region_monitor`` and
``sparsity_monitor``. ``model.model`` also names the tokenizer of ``data``.
"""

from __future__ import annotations

import warnings

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.callbacks import (
    OldPolicyRefresh,
    RolloutGeneration,
    SparsityCoverageMonitor,
    TrustRegionMonitor,
)
from lightning_troll.checkpoints import changed_options, check_checkpoint_file, non_atomic_saves
from lightning_troll.data import PromptDataModule
from lightning_troll.module import TrollModule

__all__ = ["TrollCLI", "main", "run"]

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "lightning_troll"},
    },
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
}


class TrollCLI(LightningCLI):
    """LightningCLI with the project's callbacks always on and the tokenizer linked."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(RolloutGeneration, "rollout")
        parser.add_lightning_class_args(OldPolicyRefresh, "old_policy")
        parser.add_lightning_class_args(TrustRegionMonitor, "trust_region_monitor")
        parser.add_lightning_class_args(SparsityCoverageMonitor, "sparsity_monitor")
        parser.link_arguments("model.model", "data.tokenizer")

    def parse_arguments(self, parser, args) -> None:
        """Parses, then refuses an unreadable ``--ckpt_path`` before anything is loaded."""
        super().parse_arguments(parser, args)
        self._given_model = None
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        # "last", "best", "hpc" and "registry..." are names Lightning resolves; URLs are remote
        if not path or path in ("last", "best", "hpc") or path.startswith("registry"):
            return
        if "://" not in path:
            check_checkpoint_file(path)
        self._given_model = self.config[subcommand].model.clone()

    def before_instantiate_classes(self) -> None:
        """Warns about model options the checkpoint's replaced (LightningCLI resumes with the
        hyper-parameters stored in ``--ckpt_path``, whatever the command line says)."""
        if self._given_model is None:
            return
        stored = dict(self.config[self.subcommand].model.items())
        ignored = changed_options(self._given_model, stored)  # checkpoint's -> given
        if ignored:
            rank_zero_warn(
                "--ckpt_path: a resumed run keeps the model options stored in the checkpoint; "
                "these given ones are ignored: " + "; ".join(ignored)
            )

    def before_fit(self) -> None:
        """Warns when checkpoints would not be saved atomically (see ``non_atomic_saves``)."""
        for callback in self.trainer.checkpoint_callbacks:
            directory = getattr(callback, "dirpath", None) or self.trainer.default_root_dir
            problem = non_atomic_saves(directory)
            if problem is not None:
                rank_zero_warn(problem)

    def after_fit(self) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = self.trainer.callback_metrics
        lines = ["", "lightning-troll: training finished"]
        for name in ("reward/mean", "val/accuracy", "trust_region/kl_after_max"):
            if name in metrics:
                lines.append(f"  {name:<28} {float(metrics[name]):.4f}")
        rollouts = next(
            (c for c in self.trainer.callbacks if isinstance(c, RolloutGeneration)), None
        )
        rewards = rollouts.mean_rewards if rollouts is not None else []
        if len(rewards) >= 4:
            quarter = len(rewards) // 4
            first = sum(rewards[:quarter]) / quarter
            last = sum(rewards[-quarter:]) / quarter
            lines.append(
                f"  {'mean reward, by quarter':<28} first {first:.3f} -> last {last:.3f} "
                f"({len(rewards)} rollouts)"
            )
        logger = self.trainer.logger
        if logger is not None and logger.log_dir:
            lines.append(f"  logs: {logger.log_dir}")
            lines.append(f"  view: tensorboard --logdir {logger.save_dir}")
        print("\n".join(lines))


def run(args: list[str] | None = None) -> TrollCLI:
    """Runs the command line (``args``, or ``sys.argv``) and returns the CLI object."""
    # The options of the config dataclasses are documented by a docstring under each field.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # The frozen snapshots are in eval mode on purpose; Lightning warns about any such module.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # ModelCheckpoint warns that a manually optimised module's checkpoint holds the weights after
    # the batch's optimiser steps: that is what resuming between rollouts needs.
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    return TrollCLI(
        TrollModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,
    )


def main() -> None:
    """Entry point of the ``lightning-troll`` console script."""
    run()


if __name__ == "__main__":
    main()
