"""The ``lightning-troll`` command: ``fit``/``validate`` (:mod:`~lightning_troll.cli.command`)
and ``export`` (:mod:`~lightning_troll.cli.export`)."""

from lightning_troll.cli.command import BAD_INPUT, TrollCLI, main, quarter_means, run, shows_help

__all__ = ["BAD_INPUT", "TrollCLI", "main", "quarter_means", "run", "shows_help"]
