"""A reward model as a reward: a sequence classifier scores prompt plus completion.

``rewards: {"reward_model:<folder or hub name>": 1.0}`` builds a :class:`RewardModel`; so does a
module-level instance named by import path (``my_rewards:helpfulness`` with ``helpfulness =
RewardModel("org/name")`` in ``my_rewards.py``), or a subclass's instance that changes how a
sample becomes text (:meth:`RewardModel.text`). The model is any transformers
``AutoModelForSequenceClassification`` checkpoint; it loads on the first call, with its own
tokenizer, and scores every completion of a rollout in batches, without gradients, on the
policy's device. Its keyword options come from ``model.reward_options.kwargs`` under the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["RewardModel"]


class RewardModel:
    """A sequence-classification model's logit as the reward of each completion.

    Each sample becomes a conversation, a user turn (the prompt) and an assistant turn (the
    completion), written with the reward model's own chat template; a tokenizer without one gets
    prompt and completion joined. The reward is the logit of class ``label`` (most reward models
    have one class).

    Args:
        model: a local folder or a hub name of a sequence-classification checkpoint.
        dtype: the reward model's weights: ``float32`` (default), ``bfloat16`` or ``float16``.
    """

    batched = True
    """The scorer calls it once per rollout with every completion, in the trainer's process."""

    def __init__(self, model: str | Path, dtype: str = "float32") -> None:
        if not str(model):
            raise ValueError("reward_model: give a folder or a hub name after 'reward_model:'")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"RewardModel dtype must be float32, bfloat16 or float16; got {dtype!r}"
            )
        self.model_name = str(model)
        self.dtype = getattr(torch, dtype)
        self.__name__ = f"reward_model:{self.model_name}"
        self._model: Any = None
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_name!r})"

    def load(self) -> None:
        """Loads the classifier and its tokenizer (done by the first call)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(self.model_name).expanduser()
        source = str(path) if path.exists() else self.model_name
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"  # keep the completion's end
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=self.dtype)
        if model.config.pad_token_id is None:  # batches need it to find each last token
            model.config.pad_token_id = tokenizer.pad_token_id
        self._model, self._tokenizer = model.eval().requires_grad_(False), tokenizer

    def text(self, prompt: str, completion: str, row: Mapping[str, Any]) -> str:
        """The text the classifier reads for one sample (override to change it)."""
        if getattr(self._tokenizer, "chat_template", None):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return self._tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + completion

    @torch.no_grad()
    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        rows: list[Mapping[str, Any]],
        *,
        device: torch.device | str | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        prompt_field: str | None = None,
        label: int = 0,
    ) -> list[float]:
        """One reward per completion: the classifier's logit of ``label``.

        ``device``: where it scores (the scorer passes the policy's). ``batch_size``: samples per
        forward pass. ``max_length``: tokens kept of each sample (from the left; null keeps all).
        ``prompt_field``: the row field whose text is the user turn, instead of the formatted
        prompt (which may carry the policy's own chat template).
        """
        if self._model is None:
            self.load()
        model, tokenizer = self._model, self._tokenizer
        if device is not None and model.device != torch.device(device):
            model.to(device)
        texts = [
            self.text(str(row[prompt_field]) if prompt_field else prompt, completion, row)
            for prompt, completion, row in zip(prompts, completions, rows, strict=True)
        ]
        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                truncation=max_length is not None,
                max_length=max_length,
                add_special_tokens=not getattr(tokenizer, "chat_template", None),
            ).to(model.device)
            logits = model(**batch).logits  # (b, labels)
            scores += logits[:, label].float().cpu().tolist()
        return scores


def _check(batch_size: int = 8, max_length: int | None = None, **_: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be null or an integer >= 1; got {max_length!r}")


RewardModel.check = staticmethod(_check)  # type: ignore[attr-defined]
RewardModel.max_reward = None  # type: ignore[attr-defined]
"""A reward model has no best score: ``val/accuracy`` counts full marks of the other rewards and
leaves its logit out."""
