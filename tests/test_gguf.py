"""GGUF files as policies, on a tiny file written here: the weights, the tokenizer and the chat
template read back as the model and tokenizer they were written from, directly and through a
converted folder. (`make smollm2` converts the real, quantised file; tests/test_real_model.py
checks the folder it writes.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

import gguf as gguf_file  # noqa: E402  (the package that writes and reads the format)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from lightning_troll.models import gguf  # noqa: E402
from lightning_troll.models.loading import load_policy, load_tokenizer, tiny_causal_lm  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "What is 12 + 30? The answer is 42.",
    "Lena has 3 apples and buys 5 more, so she has 8 apples.",
    "A train leaves at 9 and arrives at 11: the trip takes 2 hours.",
]
CHAT = [{"role": "user", "content": "Lena has 12 apples; how many are left after 5?"}]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of a few hundred tokens, with SmolLM2's special tokens and a chat
    template of its form."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )


def _permute(weight: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's storage order of a query or key projection (rotary halves interleaved),
    which a reader of the format undoes."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
        .numpy()
    )


def write_tiny_gguf(path: Path):
    """A tiny Llama and its tokenizer written as one GGUF file (float32 tensors, llama.cpp's
    names and layout); returns the model and tokenizer the file was written from."""
    tokenizer = _byte_level_tokenizer()
    model = tiny_causal_lm(
        vocab_size=len(tokenizer),
        seed=3,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf_file.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokenizer))
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))  # no gaps in the ids
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges([" ".join(m) for m in _merges(tokenizer)])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    permuted = {"attn_q": heads, "attn_k": kv_heads}  # parts stored in llama.cpp's row order
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name == "lm_head.weight":
            continue  # tied to the embedding: a file without `output.weight` says so
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", tensor.numpy())
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", tensor.numpy())
        else:
            _, _, layer, rest = name.split(".", 3)
            part = names[rest.removesuffix(".weight")]
            data = _permute(tensor, permuted[part]) if part in permuted else tensor.numpy()
            writer.add_tensor(f"blk.{layer}.{part}.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


def _merges(tokenizer: PreTrainedTokenizerFast) -> list[tuple[str, str]]:
    """The BPE merges of a fast tokenizer, as pairs."""
    import json

    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf"
    model, tokenizer = write_tiny_gguf(path)
    return path, model, tokenizer


def _logits(model, tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


def test_a_gguf_file_loads_as_the_model_and_tokenizer_it_was_written_from(tiny_gguf):
    path, model, tokenizer = tiny_gguf
    read = load_tokenizer(path)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert read.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == text
    assert read(text)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert read.eos_token == "<|im_end|>" and read.padding_side == "left"
    policy = load_policy(path)
    assert not hasattr(policy.config, "quantization_config") and not policy.training
    assert policy.config.tie_word_embeddings
    torch.testing.assert_close(_logits(policy, tokenizer), _logits(model, tokenizer))
    # the loader undoes llama.cpp's order of the query rows: stored as is, they would differ
    query = model.model.layers[0].self_attn.q_proj.weight.detach()
    stored = _permute(query, model.config.num_attention_heads)
    assert not np.allclose(stored, query.numpy())


def test_a_converted_gguf_file_is_a_standard_folder_of_the_same_model(tiny_gguf, tmp_path):
    path, model, tokenizer = tiny_gguf
    out = gguf.convert_gguf(path, tmp_path / "folder", card="# tiny", extra_files={"x.json": "{}"})
    assert (out / "README.md").read_text() == "# tiny" and (out / "x.json").read_text() == "{}"
    assert not (tmp_path / "folder.partial").exists()
    assert "quantization_config" not in (out / "config.json").read_text()
    policy, read = load_policy(out), load_tokenizer(out)
    torch.testing.assert_close(_logits(policy, read), _logits(model, tokenizer))
    assert read.chat_template == TEMPLATE
    with pytest.raises(FileExistsError, match="overwrite=True"):
        gguf.convert_gguf(path, out)
