"""Figures in any Lightning logger: one function per kind of figure, dispatching on the logger.

The callbacks say what to show; these functions say how each logger shows it, with its own API:

=========================  ==============  ===================  ======================  ==============
figure                     TensorBoard     Weights & Biases     MLflow                  CSV
=========================  ==============  ===================  ======================  ==============
:func:`write_table`        Markdown text   ``wandb.Table``      JSONL artifact          JSONL beside
                                                                                        metrics.csv
:func:`write_histogram`    histogram       ``wandb.Histogram``  quantile metrics        quantile
                                                                                        metrics
:func:`declare_chart`      custom scalars  (nothing)            (nothing)               (nothing)
:func:`write_chart`        (nothing: the   ``wandb.plot.       JSON artifact of the    (nothing: the
                           layout draws    line_series``        series                  metrics.csv
                           it)                                                          columns)
=========================  ==============  ===================  ======================  ==============

A logger of another type gets nothing from these (its scalars come from ``log_dict`` as usual);
register one with ``write_table.register(MyLogger)`` and so on. :func:`each_logger` calls a
function for every logger of a trainer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from functools import singledispatch
from typing import Any

import numpy
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import (
    CSVLogger,
    Logger,
    MLFlowLogger,
    TensorBoardLogger,
    WandbLogger,
)
from torch import Tensor

__all__ = [
    "QUANTILES",
    "declare_chart",
    "each_logger",
    "logged_step",
    "markdown_table",
    "write_chart",
    "write_histogram",
    "write_table",
]

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
"""The quantiles a histogram becomes in loggers without histograms (``<name>/p50``, ...)."""


def each_logger(trainer: Trainer, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """``write(logger, *args, **kwargs)`` for every logger of ``trainer``."""
    for logger in trainer.loggers:
        write(logger, *args, **kwargs)


def logged_step(trainer: Trainer) -> int:
    """The step Lightning logs the current training batch's scalars at (batches that stepped, one
    per rollout, not optimiser steps): figures written with it sit beside those scalars."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, one row each; ``|`` and line breaks in cells are escaped, so a
    chat-template prompt stays one row. Numbers are written with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        text = str(value).replace("|", "\\|").replace("\r", "").replace("\n", "⏎")
        return f"`{text}`"

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _jsonl(columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> str:
    return "".join(
        json.dumps({"step": step, **dict(zip(columns, row, strict=True))}) + "\n" for row in rows
    )


# ----------------------------------------------------------------------------- tables


@singledispatch
def write_table(
    logger: Logger, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int
) -> None:
    """A table (one row per sample) at ``step``; ``rows`` hold strings and floats."""


@write_table.register
def _(logger: TensorBoardLogger, name, columns, rows, step) -> None:
    logger.experiment.add_text(name, markdown_table(columns, rows), step)


@write_table.register
def _(logger: WandbLogger, name, columns, rows, step) -> None:
    logger.log_table(name, columns=list(columns), data=[list(r) for r in rows], step=step)


@write_table.register
def _(logger: MLFlowLogger, name, columns, rows, step) -> None:
    path = f"{name}/step_{step:07d}.jsonl"
    logger.experiment.log_text(logger.run_id, _jsonl(columns, rows, step), path)


@write_table.register
def _(logger: CSVLogger, name, columns, rows, step) -> None:
    os.makedirs(logger.log_dir, exist_ok=True)
    with open(os.path.join(logger.log_dir, f"{name}.jsonl"), "a", encoding="utf-8") as file:
        file.write(_jsonl(columns, rows, step))


# ----------------------------------------------------------------------------- histograms


@singledispatch
def write_histogram(logger: Logger, name: str, values: Tensor, step: int) -> None:
    """The distribution of ``values`` (any shape, non-empty) at ``step``."""
    _quantiles(logger, name, values, step)


def _quantiles(logger: Logger, name: str, values: Tensor, step: int) -> None:
    """The nearest thing to a histogram for a logger of scalars: a few quantiles as metrics."""
    # numpy's quantile: torch.quantile refuses more than 2**24 values (a rollout's tokens can be)
    points = numpy.quantile(values.detach().double().flatten().cpu().numpy(), QUANTILES)
    metrics = {
        f"{name}/p{round(q * 100):02d}": float(v) for q, v in zip(QUANTILES, points, strict=True)
    }
    logger.log_metrics(metrics, step=step)


@write_histogram.register
def _(logger: TensorBoardLogger, name, values, step) -> None:
    logger.experiment.add_histogram(name, values.detach().float().cpu(), step)


@write_histogram.register
def _(logger: WandbLogger, name, values, step) -> None:
    import wandb

    histogram = wandb.Histogram(values.detach().float().cpu().numpy())
    logger.experiment.log({name: histogram, "trainer/global_step": step})


# ----------------------------------------------------------------------------- line charts


@singledispatch
def declare_chart(logger: Logger, section: str, charts: dict[str, list[str]]) -> None:
    """Charts that draw logged scalars together: title -> metric names, declared before the
    fit (loggers that draw from the data instead get :func:`write_chart`)."""


@declare_chart.register
def _(logger: TensorBoardLogger, section, charts) -> None:
    layout = {title: ["Multiline", list(keys)] for title, keys in charts.items()}
    logger.experiment.add_custom_scalars({section: layout})


@singledispatch
def write_chart(
    logger: Logger, title: str, steps: Sequence[int], series: dict[str, Sequence[float]], step: int
) -> None:
    """A line chart of ``series`` (name -> one value per step) against ``steps``, drawn whole
    at ``step``; loggers whose charts come from :func:`declare_chart` or from their metrics
    need nothing more."""


@write_chart.register
def _(logger: WandbLogger, title, steps, series, step) -> None:
    import wandb

    chart = wandb.plot.line_series(
        xs=list(steps),
        ys=[list(v) for v in series.values()],
        keys=list(series),
        title=title,
        xname="step",
    )
    logger.experiment.log({title: chart, "trainer/global_step": step})


@write_chart.register
def _(logger: MLFlowLogger, title, steps, series, step) -> None:
    data = {"step": list(steps), **{k: list(v) for k, v in series.items()}}
    logger.experiment.log_dict(logger.run_id, data, f"charts/{title.replace(' ', '_')}.json")
