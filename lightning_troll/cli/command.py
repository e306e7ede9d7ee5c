"""The ``lightning-troll`` command: LightningCLI over TrollModule and PromptDataModule.

    lightning-troll fit --config configs/tinymath.yaml
    lightning-troll fit --config configs/tinymath.yaml --model.objective clip
    lightning-troll fit --help

The rollout callback, the snapshot refresh and the monitors are always present; their options
are the top-level keys ``rollout``, ``old_policy``, ``trust_region_monitor``,
``sparsity_monitor`` and ``constraint_monitor``. ``model.model`` also names the tokenizer of ``data``.

Logs and checkpoints follow Lightning's rule: TensorBoard logs in
``<trainer.default_root_dir>/lightning_logs/version_<n>`` (the root is ``runs`` unless given), and
``last.ckpt`` in its ``checkpoints`` folder (:class:`RolloutCheckpoint`, options under the
top-level key ``checkpoint``), unless a logger or a checkpoint callback of one's own is given.

Bad configuration or data, found before training starts, ends the command with
``lightning-troll: error: <message>`` on one line and exit status 2; ``--debug`` (anywhere on the
command line) or ``LIGHTNING_TROLL_DEBUG=1`` shows the traceback instead. Errors once training
runs keep their traceback.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from contextvars import ContextVar
from typing import Any, NoReturn

from jsonargparse import set_parsing_settings
from jsonargparse._common import debug_mode_active
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_troll.callbacks import (
    ConstraintMonitor,
    OldPolicyRefresh,
    ReleaseFreedMemory,
    RolloutCheckpoint,
    RolloutGeneration,
    RolloutProgressBar,
    SparsityCoverageMonitor,
    TrustRegionMonitor,
)
from lightning_troll.callbacks.checkpoint import OWN_CHECKPOINT_ONLY
from lightning_troll.callbacks.summary import TrollModelSummary
from lightning_troll.cli import export
from lightning_troll.cli.checks import (
    check_named_checkpoint,
    check_run_length,
    check_schedule_length,
    check_task,
    config_files,
)
from lightning_troll.cli.loader import MODE as LOADER_MODE
from lightning_troll.cli.loader import register as register_loader
from lightning_troll.cli.loader import stored_options, take_given_code
from lightning_troll.cli.order import overridden_options
from lightning_troll.cli.parse_errors import explain
from lightning_troll.cli.quiet import quiet_library_notices
from lightning_troll.cli.seeds import follow_run_seed
from lightning_troll.cli.stops import (
    TrainingStarted,
    fresh_folder,
    quiet_about_no_space,
    refuse,
    stop,
)
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.rewards.lookup import config_folders as reward_config_folders
from lightning_troll.training.checkpoint_io import install_atomic_saves
from lightning_troll.training.checkpoints import (
    changed_options,
    check_checkpoint_file,
)
from lightning_troll.training.faults import RunFault
from lightning_troll.training.module import DEFAULT_OPTIMIZER, TrollModule
from lightning_troll.training.moved import fold_moved_options

__all__ = ["BAD_INPUT", "TrollCLI", "main", "quarter_means", "run", "shows_help"]

TRAINER_DEFAULTS = {
    # Lightning's default logger (TensorBoard) writes to <default_root_dir>/lightning_logs
    "default_root_dir": "runs",
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
}

BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError, OSError, ImportError, MisconfigurationException
)  # fmt: skip
"""Errors that, raised before training starts, are bad configuration or data: the options'
checks (``ValueError``, ``CheckpointError``), missing or unreadable files (``OSError``), an
optional package the configuration needs but the environment lacks (``ImportError``, saying
which install adds it) and Lightning's own configuration checks."""

DEBUG_FLAG = "--debug"
DEBUG_VARIABLE = "LIGHTNING_TROLL_DEBUG"


def quarter_means(values: list[float]) -> list[float]:
    """The means of the four quarters of ``values`` (at least 4); when their number is not a
    multiple of 4, the first and the last quarter have ``len // 4`` values and the middle
    quarters share the rest."""
    if len(values) < 4:
        raise ValueError(f"quarter_means needs at least 4 values; got {len(values)}")
    size = len(values) // 4
    middle = values[size : len(values) - size]
    half = len(middle) // 2
    parts = [values[:size], middle[:half], middle[half:], values[-size:]]
    return [sum(part) / len(part) for part in parts]


_COMMAND_LINE: ContextVar[tuple[str, ...] | None] = ContextVar("command_line", default=None)
"""The command line being parsed, and None when ``--debug`` asks for jsonargparse's own errors."""


class TrollArgumentParser(LightningArgumentParser):
    """Fills in ``data.seed`` from ``seed_everything`` while parsing, before ``--print_config``
    prints, so that the printed config shows the seed used; says a parse error in a line (see
    :mod:`lightning_troll.cli.parse_errors`) instead of the whole usage; reads config files with
    the options 0.2.0 renamed folded (:mod:`lightning_troll.cli.loader`)."""

    def __init__(self, *args, **kwargs) -> None:
        register_loader()
        super().__init__(*args, **{"parser_mode": LOADER_MODE, **kwargs})

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        args = _COMMAND_LINE.get()
        if not self.exit_on_error or args is None or debug_mode_active():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = explain(message, parser, args)
        subcommand = next((a for a in args[:1] if a in ("fit", "validate", "test", "predict")), "")
        help_line = f"lightning-troll {subcommand} --help".replace("  ", " ")
        sys.stderr.write(f"lightning-troll: error: {line}\n  ({help_line} lists every option)\n")
        self.exit(2)

    def _parse_common(self, cfg, *args, **kwargs):
        # Only on the whole parse (defaults merged): a config file's part of it, parsed first
        # without defaults, may have its seed_everything replaced by the command line's.
        if kwargs.get("defaults") and not kwargs.get("nested_parse"):
            follow_run_seed(cfg)
        return super()._parse_common(cfg, *args, **kwargs)


class TrollCLI(LightningCLI):
    """LightningCLI with the project's callbacks always on and the tokenizer linked."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(RolloutGeneration, "rollout")
        parser.add_lightning_class_args(ReleaseFreedMemory, "release_memory")  # after the rollout
        parser.add_lightning_class_args(OldPolicyRefresh, "old_policy")
        parser.add_lightning_class_args(TrustRegionMonitor, "trust_region_monitor")
        parser.add_lightning_class_args(SparsityCoverageMonitor, "sparsity_monitor")
        parser.add_lightning_class_args(ConstraintMonitor, "constraint_monitor")
        parser.add_class_arguments(RolloutCheckpoint, "checkpoint", fail_untyped=False)
        parser.link_arguments("model.model", "data.tokenizer")
        parser.set_defaults({"model.optimizer": DEFAULT_OPTIMIZER})

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Adds the project's defaults, as Lightning adds its own: :class:`RolloutCheckpoint`
        unless checkpointing is off or a checkpoint callback is given, and
        :class:`RolloutProgressBar` unless the bar is off or another one is given."""
        config = self._get(self.config_init, "trainer", default={})
        given = config.get("callbacks") or []
        given = list(given) if isinstance(given, list) else [given]
        extra: list[Callback] = [TrainingStarted()]
        if config.get("enable_checkpointing") is not False and not any(
            isinstance(c, Checkpoint) for c in given
        ):
            extra.append(self._get(self.config_init, "checkpoint"))
        elif not any(isinstance(c, RolloutCheckpoint) for c in given) and any(
            isinstance(c, Checkpoint) for c in given
        ):
            rank_zero_warn(OWN_CHECKPOINT_ONLY)
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in given
        ):
            extra.append(RolloutProgressBar())
        if config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in given
        ):
            extra.append(TrollModelSummary())
        trainer = super().instantiate_trainer(**kwargs, callbacks=given + extra)
        install_atomic_saves(trainer.strategy)  # every checkpoint callback's saves, a user's too
        extra[0].fresh = fresh_folder(trainer.logger)
        return trainer

    def parse_arguments(self, parser, args) -> None:
        """Parses (config files with the options 0.2.0 renamed folded: :mod:`~lightning_troll.cli.loader`),
        then refuses a run that cannot train (see ``check_task``) and an unreadable
        ``--ckpt_path``, before anything is seeded or loaded."""
        super().parse_arguments(parser, args)
        self._given_model = None
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        if moved := fold_moved_options(config.model, config.get("data")):
            rank_zero_warn(moved)
        self._config_files = config_files(config)
        with reward_config_folders(self._config_files):
            check_task(config)
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        # "last", "best", "hpc" and "registry..." are names Lightning resolves; URLs are remote
        check_named_checkpoint(config, path)
        if not path or path in ("last", "best", "hpc") or path.startswith("registry"):
            return
        if "://" not in path:
            check_checkpoint_file(path)
        self._given_model = self.config[subcommand].model.clone()

    def _parse_ckpt_path(self) -> None:
        """Lightning's reading of the options a ``--ckpt_path`` stored, over the config, with the
        options 0.2.0 renamed folded first (:func:`~lightning_troll.cli.loader.stored_options`)."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if (options := stored_options(path)) is not None:
            self.config = self.parser.parse_object({subcommand: {"model": options}}, self.config)

    def before_instantiate_classes(self) -> None:
        """Refuses a learning-rate schedule shorter than the run; warns about model options the
        checkpoint's replaced (LightningCLI resumes with the hyper-parameters stored in
        ``--ckpt_path``, whatever the command line says)."""
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        if moved := fold_moved_options(config.model, config.get("data")):
            rank_zero_warn(moved)
        follow_run_seed(config)  # seed_everything: true is drawn after parsing
        if subcommand in (None, "fit"):  # None: built to fit by hand
            check_run_length(config)
        check_schedule_length(config)
        if self._given_model is None:
            return
        take_given_code(self._given_model, self.config[self.subcommand].model)
        stored = dict(self.config[self.subcommand].model.items())
        ignored = changed_options(self._given_model, stored)  # checkpoint's -> given
        if ignored:
            rank_zero_warn(
                "--ckpt_path: a resumed run keeps the model options stored in the checkpoint; "
                "these given ones are ignored: " + "; ".join(ignored)
            )

    def instantiate_classes(self) -> None:
        """Builds the classes with reward modules looked for beside the configs too."""
        with reward_config_folders(getattr(self, "_config_files", [])):
            super().instantiate_classes()

    def after_fit(self) -> None:
        if not self.trainer.is_global_zero:
            return
        checkpoint = self.checkpoint_callback
        stopped = checkpoint is not None and checkpoint.stopped_by is not None
        how = f"stopped by {checkpoint.stopped_by.name}" if stopped else "training finished"
        lines = ["", f"lightning-troll: {how}"]
        metrics = self.trainer.callback_metrics
        for name in ("reward/mean", "val/accuracy", "trust_region/kl_after_max"):
            if name in metrics:
                lines.append(f"  {name:<28} {float(metrics[name]):.4f}")
        rollouts = next(
            (c for c in self.trainer.callbacks if isinstance(c, RolloutGeneration)), None
        )
        rewards = rollouts.mean_rewards if rollouts is not None else []
        if len(rewards) >= 4:
            first, second, third, last = quarter_means(rewards)
            lines.append(
                f"  {'mean reward, by quarter':<28} first {first:.3f} -> {second:.3f} -> "
                f"{third:.3f} -> last {last:.3f} ({len(rewards)} rollouts)"
            )
        logger = self.trainer.logger
        if logger is not None and logger.log_dir:
            lines.append(f"  logs: {logger.log_dir}")
            lines.append(f"  view: tensorboard --logdir {logger.save_dir}")
        if checkpoint is not None and checkpoint.last_model_path:
            path = checkpoint.last_model_path
            lines.append(f"  checkpoint: {path}")
            lines.append(f"  resume: the same command with --ckpt_path {path}")
            lines.append(
                f"  export: lightning-troll export --ckpt_path {path} --output_dir <model folder>"
            )
        print("\n".join(lines))

    @property
    def checkpoint_callback(self) -> RolloutCheckpoint | None:
        """The run's :class:`RolloutCheckpoint`, if it has one."""
        callbacks = self.trainer.callbacks
        return next((c for c in callbacks if isinstance(c, RolloutCheckpoint)), None)


def shows_help(args: list[str]) -> bool:
    """Whether a command line prints option documentation: ``-h``, ``--help``, a ``--<key>.help``
    or ``--print_config`` (whose comments can hold it)."""
    return any(
        arg in ("-h", "--help")
        or arg.split("=", 1)[0].endswith(".help")
        or arg.startswith("--print_config")
        for arg in args
    )


def run(args: list[str] | None = None, debug: bool = False) -> TrollCLI:
    """Runs the command line (``args``, or ``sys.argv``) and returns the CLI object. A parse error
    prints a line or two and exits with status 2; ``debug`` prints jsonargparse's own report."""
    # The options of the config dataclasses are documented by a docstring under each field.
    # Reading those means parsing the source of every class the parser covers (Trainer,
    # LightningModule, ...), about 2 s per start on a 2-core CPU, so it is done only for a
    # command line that shows the documentation.
    given = sys.argv[1:] if args is None else args
    for message in overridden_options(list(given)):
        rank_zero_warn(message)
    set_parsing_settings(docstring_parse_attribute_docstrings=shows_help(given))
    # ModelCheckpoint warns that a manually optimised module's checkpoint holds the weights after
    # the batch's optimiser steps: that is what resuming between rollouts needs.
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    quiet_library_notices()
    token = _COMMAND_LINE.set(None if debug else tuple(given))
    try:
        return TrollCLI(
            TrollModule,
            PromptDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            parser_class=TrollArgumentParser,
            auto_configure_optimizers=False,
            args=args,
        )
    finally:
        _COMMAND_LINE.reset(token)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-troll`` console script.

    Bad input found before training (:data:`BAD_INPUT`) prints one line and exits with status 2,
    unless ``--debug`` is given or ``LIGHTNING_TROLL_DEBUG`` is set (then the traceback shows). A
    run stopped by Ctrl-C or SIGTERM, after saving its checkpoint, exits with 128 + the signal; a
    run stopped by a fault it cannot go past (:class:`RunFault`: a full disk, a reward that failed
    under ``reward_options.on_error: raise``) prints one line (and the checkpoint saved on the way
    out, if any) and exits with status 3.
    """
    given = sys.argv[1:] if args is None else args
    debug = DEBUG_FLAG in given or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    rest = [a for a in given if a != DEBUG_FLAG]
    if rest[:1] == ["export"]:
        try:
            export.main(rest[1:])
        except BAD_INPUT as error:
            if debug:
                raise
            refuse(error)
        return
    if args is None:  # LightningCLI reads sys.argv itself (and warns when both are given)
        sys.argv[1:] = rest
    hook = threading.excepthook
    if not debug:
        threading.excepthook = quiet_about_no_space(hook)
    try:
        cli = run(None if args is None else rest, debug=debug)
    except (RunFault, *BAD_INPUT) as error:
        if debug:
            raise
        stop(error)
    finally:
        threading.excepthook = hook
    checkpoint = cli.checkpoint_callback
    if checkpoint is not None and checkpoint.stopped_by is not None:
        raise SystemExit(128 + int(checkpoint.stopped_by))


if __name__ == "__main__":
    main()
