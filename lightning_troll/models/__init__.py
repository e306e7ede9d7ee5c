"""The policy and its copies: loading, LoRA, quantisation, GGUF files, snapshots, sharding.

- :mod:`~lightning_troll.models.loading`: policies and tokenizers by hub name, folder, ``.gguf``
  file or ``tinymath``; tiny test models; stop tokens;
- :mod:`~lightning_troll.models.tinymath`, :mod:`~lightning_troll.models.smollm2`: the shipped
  demo policy (``assets/tinymath``) and its task; SmolLM2-135M-Instruct fetched into ``models/``;
- :mod:`~lightning_troll.models.snapshots`, :mod:`~lightning_troll.models.quantize`: the
  behaviour-policy snapshot (a copy, bfloat16, int8, or the policy itself);
- :mod:`~lightning_troll.models.lora`, :mod:`~lightning_troll.models.sharding`,
  :mod:`~lightning_troll.models.gguf`: adapters, FSDP2, ``.gguf`` files.

Imports only torch, transformers (and peft, gguf where asked for): no Lightning.
"""

from lightning_troll.models.loading import (
    DTYPES,
    TINYMATH,
    load_policy,
    load_tokenizer,
    stop_token_ids,
    tiny_causal_lm,
)

__all__ = [
    "DTYPES",
    "TINYMATH",
    "load_policy",
    "load_tokenizer",
    "stop_token_ids",
    "tiny_causal_lm",
]
