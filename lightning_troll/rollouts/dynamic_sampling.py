"""Dynamic sampling (DAPO): a rollout of prompt groups whose rewards have some spread.

Under group-relative advantages a group whose G rewards are all equal has advantages 0 and
carries no gradient. Dynamic sampling samples more rounds of prompts and keeps the first
``target`` groups with spread, in sampling order; after a capped number of rounds it fills the
rollout up with groups without spread, so every rollout (and every process) keeps its size.

Notation: P prompts of a round, G samples per prompt, B = P * G sequences, S prompt length (left
padded), T response length (right padded). Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DynamicSamplingConfig",
    "cat_sequences",
    "check_dynamic_sampling",
    "choose_groups",
    "group_rows",
]


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (``model.dynamic_sampling.enabled``)."""

    enabled: bool = False
    """Groups without reward spread leave the rollout, and more prompts are sampled until it
    holds ``data.batch_size`` informative groups."""
    max_rounds: int = 3
    """The most extra rounds per rollout, >= 1 (then the rollout is filled up with groups without
    spread, warned once)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(
                f"model.dynamic_sampling.enabled must be true or false; got {self.enabled!r}"
            )
        rounds = self.max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(
                f"model.dynamic_sampling.max_rounds must be an integer >= 1; got {rounds!r}"
            )


def check_dynamic_sampling(config: DynamicSamplingConfig, group_size: int) -> None:
    """Refuses dynamic sampling with groups of one, which never have reward spread."""
    if config.enabled and group_size < 2:
        raise ValueError(
            f"model.dynamic_sampling.enabled=true needs model.group_size >= 2 (a group of one "
            f"never has reward spread); got group_size={group_size}"
        )


def choose_groups(informative: list[Tensor], target: int) -> tuple[list[Tensor], int]:
    """Which groups of each round the rollout keeps.

    Args:
        informative: per round, a (P_r,) bool tensor, True where the group has reward spread.
        target: the groups the rollout holds (the prompts of one round).

    Returns:
        Per round the (ascending) indices of its kept groups, and how many of the kept groups are
        informative: the first ``target`` informative groups in sampling order, then, if there are
        fewer, the first groups without spread.
    """
    flags = torch.cat([f.detach().cpu().bool() for f in informative])  # (sum P_r,)
    order = torch.cat([flags.nonzero().flatten(), (~flags).nonzero().flatten()])
    keep = order[:target].sort().values  # (target,) global group indices
    kept, start = [], 0
    for part in informative:
        end = start + part.numel()
        kept.append(keep[(keep >= start) & (keep < end)] - start)
        start = end
    return kept, int(flags[keep].sum())


def group_rows(groups: Tensor, group_size: int) -> Tensor:
    """Group indices (g,) -> the indices (g * G,) of their sequences, prompt-major."""
    offsets = torch.arange(group_size, device=groups.device)
    return (groups.unsqueeze(-1) * group_size + offsets).flatten()


def cat_sequences(
    parts: list[tuple[Tensor, Tensor, Tensor]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenates sampled sequences of different prompt and response lengths.

    Each part is ``(input_ids (B_r, S_r + T_r), attention_mask (B_r, S_r + T_r), response_mask
    (B_r, T_r))``; the result has every prompt left padded to S = max S_r and every response
    right padded to T = max T_r: ``(B, S + T)``, ``(B, S + T)``, ``(B, T)``. One part is returned
    as it is.
    """
    if len(parts) == 1:
        return parts[0]
    prompt = max(ids.shape[1] - response.shape[1] for ids, _, response in parts)  # S
    length = max(response.shape[1] for _, _, response in parts)  # T
    ids_out, attention_out, response_out = [], [], []
    for ids, attention, response in parts:
        b, t = response.shape
        s = ids.shape[1] - t
        ids_new = ids.new_full((b, prompt + length), pad_id)  # (B_r, S + T)
        attention_new = attention.new_zeros((b, prompt + length))
        ids_new[:, prompt - s : prompt + t] = ids
        attention_new[:, prompt - s : prompt + t] = attention
        response_new = response.new_zeros((b, length))  # (B_r, T)
        response_new[:, :t] = response
        ids_out.append(ids_new)
        attention_out.append(attention_new)
        response_out.append(response_new)
    return torch.cat(ids_out), torch.cat(attention_out), torch.cat(response_out)
