"""Prompt data for rollouts: a LightningDataModule that yields batches of P prompts.

Rows come from the built-in TinyMath generator, a local ``.json``/``.jsonl``/``.parquet`` file
or a hub dataset, read by :class:`~lightning_troll.tasks.data.sources.PromptSource`. ``setup`` formats every
row with ``template`` (optionally inside the tokenizer's chat template), tokenizes it once and
checks it against ``max_prompt_tokens``; the dataloaders then yield :class:`PromptBatch`
records: the prompt texts, their unpadded token ids and the rows, whose gold answer reward
functions read from ``row["answer"]``.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lightning_troll.tasks.data.formatting import PromptFormatter
from lightning_troll.tasks.data.prompts import (
    PLAIN_TEMPLATE,
    EpochShuffleSampler,
    PromptBatch,
    PromptItem,
    ResumableLoader,
    check_count,
    collate_prompts,
    read_rows,
    shared_in_order,
    template_fields,
    write_jsonl,
)
from lightning_troll.tasks.data.sources import PromptSource

__all__ = [
    "EpochShuffleSampler",
    "PromptBatch",
    "PromptDataModule",
    "PromptItem",
    "collate_prompts",
    "read_rows",
    "write_jsonl",
]


class PromptDataModule(LightningDataModule):
    """Prompts for rollouts: batches of ``batch_size`` prompts, shuffled each epoch with ``seed``.

    Args:
        source: Where the rows come from: ``"tinymath"`` (the built-in arithmetic generator), a
            local ``.json``/``.jsonl``/``.parquet`` file, or a hub dataset name (read with
            ``datasets.load_dataset(source, dataset_config, split=...)``). A local folder is
            refused: name the file in it.
        dataset_config: The hub dataset's configuration name (e.g. ``"main"`` for gsm8k).
        train_split: Split of the hub dataset (or TinyMath generator) to train on; slices such as
            ``"train[:1000]"`` work for hub datasets. Ignored for local files.
        val_split: Split to validate on, like ``train_split``.
        prompt_field: Row field holding the prompt (or question); ``{prompt}`` in ``template``.
        answer_field: Row field holding the gold answer; batches carry it as ``row["answer"]``
            (overwriting a field of that name). None: the rows have no answers.
        template: Format string giving the prompt text from a row; may use any row field, with
            ``{prompt}`` standing for the ``prompt_field`` value, e.g. ``"Q: {prompt}\\nA:"``.
        chat_template: Write prompts with the tokenizer's chat template, the assistant's turn
            opened (``add_generation_prompt=True``). True: every prompt, a plain one as a user
            message. False: none (conversational rows are refused). None (the default): the
            conversational rows (lists of messages), and every row when ``system_prompt`` is
            set; plain text stays as it is.
        system_prompt: System message placed before the user message; refused with
            ``chat_template=False``.
        tokenizer: Tokenizer name or path (``"tinymath"`` is the built-in one), loaded with
            ``lightning_troll.models.loading.load_tokenizer``; a tokenizer object is used as is.
        batch_size: Prompts per rollout on each device (G completions are generated per prompt).
        val_batch_size: Prompts per validation batch.
        num_train: Training rows: problems generated for ``"tinymath"``; for files and hub
            datasets the first ``num_train`` rows (None or 0: all of them).
        num_val: Validation rows: problems generated for ``"tinymath"``; rows held out of a local
            source file (chosen with ``seed``) when there is no ``val_file``; otherwise the first
            ``num_val`` rows of the validation split or file (None: all). 0 turns validation off.
        max_prompt_tokens: Longest prompt allowed, in tokens; a longer one stops ``setup``.
        seed: Seed of the per-epoch shuffle, the TinyMath problems and the held-out rows; null
            follows the run's seed (``seed_everything``, which ``lightning-troll`` fills in and
            ``--print_config`` shows; else the seed Lightning's ``seed_everything`` set, or 0).
        val_file: A local ``.json``/``.jsonl``/``.parquet`` file of validation rows (any source).
        val_samples: Completions sampled per validation prompt (at ``model.sampling``) besides
            the greedy one, logged as ``val/pass@k`` and ``val/mean@k`` with k = val_samples;
            0 validates greedily only.
    """

    def __init__(
        self,
        source: str = "tinymath",
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str = "test",
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        template: str = PLAIN_TEMPLATE,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
        tokenizer: str | PreTrainedTokenizerBase = "tinymath",
        batch_size: int = 8,
        val_batch_size: int = 64,
        num_train: int | None = 20000,
        num_val: int | None = 200,
        max_prompt_tokens: int = 64,
        seed: int | None = None,
        val_file: str | None = None,
        val_samples: int = 0,
    ) -> None:
        super().__init__()
        if seed is None:  # the run's seed, as Lightning's seed_everything recorded it
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.save_hyperparameters(ignore=[] if isinstance(tokenizer, str) else ["tokenizer"])
        self.row_source = PromptSource(
            source, dataset_config, train_split, val_split, num_train, num_val, seed, val_file
        )
        """Reads the rows; checks the options that say where they are and how many to take."""
        for option, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            check_count(option, value, 1, none_ok=False)
        check_count("max_prompt_tokens", max_prompt_tokens, 1, none_ok=False)
        check_count("val_samples", val_samples, 0, none_ok=False)
        check_count("seed", seed, 0, none_ok=False)
        if chat_template is not None and not isinstance(chat_template, bool):
            raise ValueError(
                f"data.chat_template must be true, false or null (auto: conversational rows); "
                f"got {chat_template!r}"
            )
        if system_prompt is not None and chat_template is False:
            raise ValueError(
                f"data.system_prompt={system_prompt[:40]!r} needs the chat template, but "
                "data.chat_template=false (without a chat template, put the instructions in "
                "data.template)"
            )
        if not isinstance(tokenizer, (str, PreTrainedTokenizerBase)):
            raise ValueError(
                f"data.tokenizer must be a name or path, or a transformers tokenizer; got {tokenizer!r}"
            )
        self.template_fields = template_fields(template)
        self.source, self.dataset_config, self.val_file = source, dataset_config, val_file
        self.train_split, self.val_split = train_split, val_split
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.template, self.chat_template, self.system_prompt = (
            template,
            chat_template,
            system_prompt,
        )
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.num_train, self.num_val = num_train, num_val
        self.max_prompt_tokens, self.seed, self.val_samples = max_prompt_tokens, seed, val_samples
        self._tokenizer_spec = tokenizer
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.train_items: list[PromptItem] | None = None
        """Prepared training prompts (after ``setup``)."""
        self.train_loader: ResumableLoader | None = None
        """The loader of the last train_dataloader() call (its peek() shows the next batch)."""
        self.val_items: list[PromptItem] | None = None
        """Prepared validation prompts (after ``setup``)."""

    # ------------------------------------------------------------------------- loading

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, loaded on first use."""
        if self._tokenizer is None:
            spec = self._tokenizer_spec
            if isinstance(spec, str):
                from lightning_troll.models.loading import load_tokenizer

                spec = load_tokenizer(spec)
            if self.chat_template and not getattr(spec, "chat_template", None):
                raise ValueError(
                    f"data.chat_template=true but the tokenizer {self._tokenizer_spec!r:.80} has "
                    "no chat template; set data.chat_template: null or use a chat model's tokenizer"
                )
            self._tokenizer = spec
        return self._tokenizer

    def prepare_data(self) -> None:
        """Downloads a hub dataset once (on global rank 0) so ``setup`` reads it from the cache."""
        self.row_source.download()

    def setup(self, stage: str | None = None) -> None:
        """Loads, formats, tokenizes and checks the rows (once)."""
        if self.train_items is None and stage in (None, "fit"):
            rows = self.row_source.train_rows()
            replicas = self._process_share()["replicas"]  # each takes batch_size rows a rollout
            if len(rows) < self.batch_size * replicas:
                per = f" x {replicas} processes" if replicas > 1 else ""
                raise ValueError(
                    f"data.batch_size={self.batch_size}{per} is larger than the {len(rows)} "
                    f"training rows of {self._describe()}; lower data.batch_size or add rows"
                )
            self.train_items = self._prepare(rows, "train")
        if self.val_items is None:
            self.val_items = self._prepare(self.row_source.val_rows(), "validation")
            if not self.val_items and self.num_val != 0:
                raise ValueError(
                    f"data.num_val={self.num_val}: there are no validation rows in "
                    f"{self._describe('validation')} (split {self.val_split!r}); give rows, or "
                    "data.num_val: 0 to validate nothing"
                )

    def _describe(self, split: str = "train") -> str:
        return self.row_source.describe(split)

    # ------------------------------------------------------------------------- preparation

    def _prepare(self, rows: list[dict[str, Any]], split: str) -> list[PromptItem]:
        """Checks fields, formats, tokenizes and checks the length of every row."""
        if not rows:
            return []
        formatter = PromptFormatter(
            prompt_field=self.prompt_field,
            answer_field=self.answer_field,
            template=self.template,
            chat_template=self.chat_template,
            system_prompt=self.system_prompt,
            max_prompt_tokens=self.max_prompt_tokens,
            tokenizer=self.tokenizer,
            describe=self._describe,
            lines=self.row_source.lines.get(split),
        )
        shadowed = formatter.shadowed(rows) if split == "train" else None
        if shadowed is not None:
            rank_zero_warn(shadowed)
        return formatter.prepare(rows, split)

    # ------------------------------------------------------------------------- loaders

    def train_dataloader(self) -> ResumableLoader:
        """Batches of ``batch_size`` prompts per process, reshuffled each epoch; the last partial
        one dropped. With N processes, step k's N batches together are step k's batch of a
        single-process run with ``N * batch_size`` prompts.

        Resumes mid-epoch from a checkpoint (see :class:`~lightning_troll.tasks.data.prompts.ResumableLoader`).
        """
        if self.train_items is None:
            self.setup("fit")
        self.train_loader = ResumableLoader(
            self.train_items,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(
                len(self.train_items), self.seed, self.batch_size, **self._process_share()
            ),
            drop_last=True,
            collate_fn=collate_prompts,
            num_workers=0,
            generator=torch.Generator(),  # iterating must not draw from the global RNG
            position=self._position,
        )
        return self.train_loader

    def _process_share(self) -> dict[str, int]:
        """This process's rank and the number of processes that share the data."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        if not kwargs:
            return {"rank": 0, "replicas": 1}
        return {"rank": kwargs["rank"], "replicas": kwargs["num_replicas"]}

    def _position(self) -> tuple[int, int]:
        """(epoch, rollouts finished in it) of the trainer fitting with this DataModule."""
        loop = self.trainer.fit_loop
        return self.trainer.current_epoch, loop.epoch_loop.batch_progress.current.processed

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in order, shared out over processes as
        :func:`~lightning_troll.tasks.data.prompts.shared_in_order` says; an empty list (no
        validation) when there are no rows."""
        if self.val_items is None:
            self.setup("validate")
        if not self.val_items:
            return []
        items, sampler = shared_in_order(self.val_items, **self._process_share())
        return DataLoader(
            items,
            batch_size=self.val_batch_size,
            sampler=sampler,
            shuffle=False,
            collate_fn=partial(collate_prompts, samples=self.val_samples),
            num_workers=0,
            generator=torch.Generator(),  # iterating must not draw from the global RNG
        )

    def state_dict(self) -> dict[str, Any]:
        """The seed: the shuffle order is a function of (seed, epoch), nothing else is stateful."""
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("seed", self.seed) != self.seed:
            rank_zero_warn(
                f"data.seed={self.seed} differs from the checkpoint's {state_dict['seed']}: the "
                "resumed run sees the prompts in a different order"
            )
