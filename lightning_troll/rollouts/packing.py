"""The padding-free forward: a micro-batch's sequences packed into one row, each with its own
positions, so a forward costs the sequences' real tokens and not ``rows x (longest prompt +
longest response)``.

transformers tells packed sequences apart by their positions: called with ``position_ids`` that
start again at 0 and no attention mask, a model whose attention builds its mask through
``transformers.masking_utils`` (``create_causal_mask``: every Llama-like model of transformers 5)
attends within each sequence only (a block-diagonal causal mask for ``sdpa`` and ``eager``,
variable-length kernels for flash attention). :func:`packs` says whether a model does; others
are run padded. Nothing here imports Lightning.

Notation: B sequences, S prompt length (left padded), T response length (right padded),
L = S + T, M packed tokens (the real ones, ``attention_mask.sum()``), H hidden size.
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

__all__ = ["packed_response_hidden", "packs"]


def packs(model: nn.Module) -> bool:
    """True where ``model``'s attention keeps packed sequences apart (its decoder's module builds
    masks with ``transformers.masking_utils.create_causal_mask``)."""
    get_decoder = getattr(model, "get_decoder", None)
    if get_decoder is None:
        return False
    module = sys.modules.get(type(get_decoder()).__module__)
    maker = getattr(module, "create_causal_mask", None)
    return getattr(maker, "__module__", "") == "transformers.masking_utils"


def packed_response_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    captured: list[Tensor],
    no_logits: Tensor,
) -> Tensor:
    """The hidden states that predict each response token, (B, T, H), from one forward of the
    sequences' real tokens packed into one row (zeros at response padding). ``captured`` is the
    list the decoder's output is appended to (``forward.response_hidden``'s hook)."""
    mask = attention_mask.bool()  # (B, L)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L), as generation makes them
    model(
        input_ids=input_ids[mask].unsqueeze(0),  # (1, M)
        position_ids=positions[mask].unsqueeze(0),  # (1, M): from 0 again at each sequence
        attention_mask=None,  # what makes transformers read the positions as packed sequences
        use_cache=False,
        logits_to_keep=no_logits,
    )
    hidden = captured[-1][0]  # (M, H)
    packed_at = mask.flatten().long().cumsum(0).view_as(mask) - 1  # (B, L) each token's index
    start = mask.shape[1] - response_length  # S
    before = packed_at[:, start - 1 : -1]  # (B, T) the token that predicts each response column
    real = mask[:, start:] & mask[:, start - 1 : -1]  # (B, T)
    rows = hidden[before.clamp_min(0)]  # (B, T, H)
    return rows * real.unsqueeze(-1).to(rows.dtype)  # (B, T, H), zeros at padding
