"""Where a run's ``data.seed`` and ``model.optimization.seed`` come from when the command line leaves them
unset: the run's seed (``seed_everything``), or on a resume the seed the checkpoint's data module
saved."""

from __future__ import annotations

from lightning_troll.training.checkpoints import stored_data_seed

__all__ = ["follow_run_seed"]


def follow_run_seed(config) -> None:
    """Sets ``data.seed`` and ``model.optimization.seed`` to the run's seed (``seed_everything``) where they
    are unset (null) and the run's seed is an integer, so that runs with different seeds see
    different prompts in a different order, not only different samples.

    On a resume (``--ckpt_path``) an unset ``data.seed`` takes the checkpoint's first
    (:func:`~lightning_troll.training.checkpoints.stored_data_seed`), as ``model.optimization.seed`` comes back
    with the checkpoint's model options: another run seed (a config changed in between) would
    hold out other rows of a data file, some of them rows the run trained on, and shuffle the
    prompts anew."""
    path = config.get("ckpt_path")
    if path and config.get("data") is not None and config.get("data.seed") is None:
        config["data.seed"] = stored_data_seed(path)
    seed = config.get("seed_everything")
    if isinstance(seed, bool) or not isinstance(seed, int):
        return
    for section in ("data", "model.optimization"):
        if config.get(section) is not None and config.get(f"{section}.seed") is None:
            config[f"{section}.seed"] = seed
