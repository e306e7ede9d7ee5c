"""The model summary printed when a fit starts, without Lightning's FLOPs column.

Lightning counts FLOPs by running the module on its ``example_input_array``; a TrollModule has
none (a rollout is not one input tensor), so the column and its total always read 0. This
summary leaves them out; everything else is Lightning's.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from typing_extensions import override

__all__ = ["TrollModelSummary"]

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")


class TrollModelSummary(ModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` without FLOPs."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns
        )
        lines = [line for line in table.splitlines() if not line.endswith("Total Flops")]
        log.info("\n" + "\n".join(lines))
