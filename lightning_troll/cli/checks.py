"""Checks of a parsed ``lightning-troll`` command line that need several sections at once, made
before any class is built (``TrollCLI.before_instantiate_classes``)."""

from __future__ import annotations

import importlib
import math
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.callbacks import (
    ConstraintMonitor,
    RolloutGeneration,
    SparsityCoverageMonitor,
    TrustRegionMonitor,
)
from lightning_troll.callbacks.refresh_options import check_refresh, check_staleness_world
from lightning_troll.engines.base import EngineConfig
from lightning_troll.engines.servers import ServerEngine, check_servers_answer
from lightning_troll.models.loading import check_reachable
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.data.preflight import check_data_files, check_hub_dataset, check_prompts
from lightning_troll.tasks.data.prompts import PLAIN_TEMPLATE
from lightning_troll.tasks.rewards.registry import resolve_reward
from lightning_troll.training.preflight import (
    check_episode_prompts,
    check_module_options,
    check_rollout_split,
    episode_rows_problem,
    field_of,
    task_rewards,
)
from lightning_troll.training.rollout_parts import check_engine_world

__all__ = [
    "check_checkpointing",
    "check_named_checkpoint",
    "check_optimizer",
    "check_run_length",
    "check_schedule_length",
    "check_scheduler",
    "check_sections",
    "check_task",
    "config_files",
]


def check_run_length(config) -> None:
    """Refuses a ``fit`` of no length: ``trainer.max_steps`` or ``trainer.max_epochs`` 0 would
    sample and train nothing and still end as a finished run, with a checkpoint of the start."""
    for option, allowed in (
        ("max_steps", "-1 (no limit)"),
        ("max_epochs", "-1 or None (no limit)"),
    ):
        if config.trainer.get(option) == 0:
            raise ValueError(
                f"trainer.{option}=0: the run would train nothing; give a positive number, "
                f"or {allowed}"
            )


def check_schedule_length(config) -> None:
    """Refuses an LR scheduler of a fixed length (``total_steps``, as ``OneCycleLR`` has) that
    ends before ``trainer.max_steps``: it would stop the run with an error one step after its end,
    minutes or hours in."""
    scheduler = config.model.get("lr_scheduler")
    total = (getattr(scheduler, "init_args", None) or {}).get("total_steps")
    max_steps = config.trainer.get("max_steps")
    if total is None or max_steps is None or 0 <= max_steps <= total:
        return
    steps = "-1 (no limit)" if max_steps < 0 else max_steps
    raise ValueError(
        f"model.lr_scheduler.init_args.total_steps={total} is smaller than trainer.max_steps="
        f"{steps}: {scheduler.class_path.rsplit('.', 1)[-1]} schedules {total} optimiser steps "
        "and raises at the next one; set total_steps to trainer.max_steps"
    )


def _imported(spec):
    """``(class_path, class, init_args)`` of a ``class_path``/``init_args`` section, or None where
    it names no class that imports (the run will say)."""
    class_path = getattr(spec, "class_path", None)
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    init_args = getattr(spec, "init_args", None) or {}
    return class_path, cls, dict(init_args if isinstance(init_args, dict) else vars(init_args))


def check_optimizer(config) -> None:
    """Builds ``model.optimizer`` on a one-number parameter, so that its own checks (a negative
    learning rate, an argument it does not take) fail before the model loads, naming the option;
    warns about a learning rate of 0, with which the policy never changes. Then builds
    ``model.lr_scheduler`` on it and steps it twice (or ``trainer.max_steps`` times, if fewer):
    a schedule of no length (``T_max: 0``, ``step_size: 0``) fails only at its first step, and one
    that turns the learning rate negative or not finite would train the wrong way. Other failures
    (a GPU-only optimiser on a CPU) are left for the run to meet."""
    found = _imported(config.model.get("optimizer"))
    if found is None:
        return
    class_path, optimizer_class, init_args = found
    try:
        optimizer = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **init_args)
    except (ValueError, TypeError) as error:
        raise ValueError(f"model.optimizer.init_args ({class_path}): {error}") from None
    except Exception:  # noqa: BLE001 - not a value the user gave: the run will say
        return
    if any(group.get("lr") == 0 for group in optimizer.param_groups):
        rank_zero_warn(
            f"model.optimizer.init_args.lr=0 ({class_path}): every optimiser step leaves the "
            "policy as it is, so the run trains nothing"
        )
    max_steps = config.trainer.get("max_steps")
    steps = max_steps if isinstance(max_steps, int) and 0 < max_steps < 2 else 2
    check_scheduler(config.model.get("lr_scheduler"), optimizer, steps)


def check_scheduler(spec, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Builds the ``model.lr_scheduler`` section on ``optimizer`` and takes ``steps`` steps
    (see :func:`check_optimizer`)."""
    found = _imported(spec)
    if found is None:
        return
    class_path, scheduler_class, init_args = found
    where, step = f"model.lr_scheduler.init_args ({class_path})", 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step the optimiser first": it has no gradients
            scheduler = scheduler_class(optimizer, **init_args)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                return  # steps on a metric, not on optimiser steps
            for step in range(1, steps + 1):
                optimizer.step()
                scheduler.step()
                bad = [lr for lr in scheduler.get_last_lr() if not 0 <= lr < math.inf]
                if bad:
                    raise ValueError(
                        f"the learning rate is {bad[0]} after {step} optimiser step(s); "
                        "it must stay a finite number >= 0"
                    )
    except ZeroDivisionError:
        raise ValueError(
            f"{where}: the schedule divides by zero at optimiser step {step}; a period or a "
            "length of 0 is not allowed"
        ) from None
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None
    except Exception:  # noqa: BLE001 - not a value the user gave: the run will say
        return


def _callback_classes(config) -> list[tuple[str, type]]:
    """(name, class) of each ``trainer.callbacks`` entry whose class path imports."""
    callbacks = config.trainer.get("callbacks") or []
    found = []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        imported = _imported(callback)
        if imported is not None and isinstance(imported[1], type):
            found.append((imported[0].rpartition(".")[2], imported[1]))
    return found


def check_checkpointing(config) -> None:
    """Lightning's refusal of a checkpoint callback with ``trainer.enable_checkpointing: false``,
    made before the model loads (the trainer is built after it)."""
    if config.trainer.get("enable_checkpointing") is not False:
        return
    for name, cls in _callback_classes(config):
        if issubclass(cls, Checkpoint):
            raise ValueError(
                "Trainer was configured with enable_checkpointing=False but trainer.callbacks "
                f"holds {name}, a checkpoint callback; drop one or the other"
            )


def beside_a_config(error: str, data, configs: list[str]) -> str:
    """What to add to ``error``, a data file's "does not exist", when the path, read from the
    working directory as every path of the command is, names a file beside a ``--config`` file."""
    for option in ("source", "val_file"):
        value = data.get(option)
        if not isinstance(value, str) or not error.startswith(f"data.{option}: file {value!r} "):
            continue
        for config in configs:
            config = Path(config).resolve()
            there = config.parent / value
            if not Path(value).is_absolute() and there.is_file():
                return (
                    f"; paths are read from the working directory {Path.cwd()}, and {value!r} "
                    f"lies beside the config {config}: give data.{option}={str(there)!r}"
                )
    return ""


def check_named_checkpoint(config, path: str) -> None:
    """Refuses ``--ckpt_path last`` (or ``best``) where no ``ModelCheckpoint`` is configured:
    Lightning looks those names up among its own checkpoint callbacks, finds none, warns and
    starts afresh, and ``RolloutCheckpoint`` keeps ``last.ckpt`` by path."""
    if path not in ("last", "best"):
        return
    if any(issubclass(cls, ModelCheckpoint) for _, cls in _callback_classes(config)):
        return
    raise ValueError(
        f"--ckpt_path {path}: no ModelCheckpoint is configured to look it up in, so the run would "
        "start afresh; give the path of the checkpoint (the end of a run prints it, "
        "<log folder>/checkpoints/last.ckpt)"
    )


def config_files(config) -> list[str]:
    """The ``--config`` files of a parsed command line, as absolute paths (inline YAML left out)."""
    return [p.absolute for p in config.get("config") or [] if getattr(p, "absolute", None)]


SECTIONS = {
    "rollout": RolloutGeneration,
    "trust_region_monitor": TrustRegionMonitor,
    "sparsity_monitor": SparsityCoverageMonitor,
    "constraint_monitor": ConstraintMonitor,
}
"""The command's callback sections whose classes check their own options when built."""


def _options(section) -> dict:
    return section.as_dict() if hasattr(section, "as_dict") else dict(section or {})


def check_sections(config) -> None:
    """Builds the data module and the callbacks of :data:`SECTIONS` from their options once,
    before the model loads (LightningCLI builds the model first), so that a bad value gets their
    own one-line refusal naming the option there and not after minutes of loading weights. A
    fresh run's local prompts are then prepared with the tokenizer alone (:func:`check_prompts`);
    a resumed run's were checked when it began, with the tokenizer the checkpoint names."""
    data = PromptDataModule(**_options(config.data))
    if not config.get("ckpt_path"):
        check_prompts(data)
    for section, cls in SECTIONS.items():
        if config.get(section) is not None:
            cls(**_options(config.get(section)))


def check_task(config) -> None:
    """Refuses, before the model loads, a run that cannot train: data other than TinyMath with no
    reward, a reward module or function that cannot be found (looked for in the working
    directory, then beside the configs), a minibatch larger than the rollout, data files that
    cannot be read or lack a field the options need (:func:`check_data_files`), a hub dataset
    that is neither cached nor on a hub this machine reaches (:func:`check_hub_dataset`), and
    vLLM servers given by address that do not answer
    (:func:`~lightning_troll.engines.servers.check_servers_answer`)."""
    model, data = config.model, config.data
    check_module_options(
        model.get("objective"),
        model.get("advantages"),
        model.get("group_size"),
        model.get("engine"),
    )
    for spec in task_rewards(model.get("rewards"), data.get("source")):
        resolve_reward(spec)
    minibatch = (model.get("optimization") or {}).get("minibatch_size")
    check_rollout_split(minibatch, data.get("batch_size"), model.get("group_size"))
    check_episode_prompts(
        model.get("episodes"), data.get("template", PLAIN_TEMPLATE), data.get("system_prompt")
    )
    if not config.get("ckpt_path"):  # resuming, the checkpoint's stored model.model is used
        check_reachable(model.get("model") or "tinymath")
    engine = model.get("engine")
    if field_of(engine, EngineConfig, "name") == ServerEngine.name:
        check_servers_answer(field_of(engine, EngineConfig, "options"))
    try:
        check_data_files(data, episode_rows_problem(model.get("episodes")))
    except ValueError as error:
        hint = beside_a_config(str(error), data, config_files(config))
        raise ValueError(f"{error}{hint}") from None
    check_hub_dataset(data.get("source"))
    check_optimizer(config)
    check_checkpointing(config)
    check_sections(config)
    refresh = config.get("old_policy") or {}
    check_refresh(
        refresh.get("every_n_rollouts", 1),
        refresh.get("max_staleness", 0),
        model.get("snapshot"),
        model.get("lora"),
    )
    world = planned_world(config.trainer)
    if world is not None:
        check_staleness_world(refresh.get("max_staleness", 0), world)
        check_engine_world(
            field_of(engine, EngineConfig, "name"), field_of(engine, EngineConfig, "options"), world
        )


def planned_world(trainer) -> int | None:
    """The processes ``trainer.devices`` x ``trainer.num_nodes`` will start, where the options say
    (a count or a list of devices); None where Lightning decides (``auto``, -1): the run's own
    setup checks it then."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return None
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return None
    return devices * nodes
