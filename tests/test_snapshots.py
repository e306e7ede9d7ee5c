"""Snapshot kinds without a trainer: quantisation invariants, closeness, memory, options."""

from __future__ import annotations

import pytest
import torch

from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.quantize import Int8Embedding, Int8Linear, quantize_rows
from lightning_troll.models.snapshots import SnapshotConfig, module_bytes
from lightning_troll.rollouts.rollout import response_logits
from tests.test_training import make_module


def logits_of(model, seed=0):
    """Float32 logits of 4 random sequences of 12 tokens, the last 6 as the response."""
    ids = torch.randint(3, 17, (4, 12), generator=torch.Generator().manual_seed(seed))
    return response_logits(model, ids, torch.ones_like(ids), 6, 1.0).float()  # (4, 6, V)


def test_quantize_rows_rounds_to_the_nearest_step_of_each_rows_absmax():
    weight = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row stays exactly zero
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    nonzero = [0, 1, 2, 4, 5]
    # the largest entry of a row maps to +-127; every entry is off by at most half a step
    assert torch.equal(q[nonzero].abs().amax(1), torch.full((5,), 127, dtype=torch.int8))
    torch.testing.assert_close(scale[nonzero], weight[nonzero].abs().amax(1) / 127)
    error = (weight - q.float() * scale[:, None]).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[3], torch.zeros(40, dtype=torch.int8))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_low_precision_snapshot_logits_are_close_to_the_exact_copy(tiny_model_dir, dtype):
    """First-order error bound: every weight is off by a relative 2**-9 (bfloat16 rounding) or at
    most 1/254 of its row's absmax (int8: half a step of absmax / 127), so each of the ~10 matmuls
    a token passes through (2 layers x attention and MLP projections, plus the output layer) adds
    about that much relative error: <= 10 * 0.4% = 4% of the logit scale; we allow 5%. The
    log-softmax differences obey the same bound."""
    exact = make_module(tiny_model_dir)
    low = make_module(tiny_model_dir, snapshot=SnapshotConfig(dtype=dtype))
    reference, approx = logits_of(exact.old_policy), logits_of(low.old_policy)
    scale = reference.abs().max()
    difference = (approx - reference).abs().max()
    assert 0 < difference <= 0.05 * scale, (float(difference), float(scale))
    logp_difference = (approx.log_softmax(-1) - reference.log_softmax(-1)).abs().max()
    assert logp_difference <= 0.05 * scale
    assert approx.dtype == torch.float32
    assert torch.equal(logits_of(low.policy), reference), "the policy is untouched"


def test_int8_snapshot_quantises_every_linear_and_embedding_and_keeps_them_tied(tiny_model_dir):
    module = make_module(tiny_model_dir, snapshot=SnapshotConfig(dtype="int8"))
    snapshot = module.old_policy
    layers = [m for m in snapshot.modules() if isinstance(m, Int8Linear | Int8Embedding)]
    assert not [
        m for m in snapshot.modules() if isinstance(m, torch.nn.Linear | torch.nn.Embedding)
    ]
    assert len(layers) == 2 * 7 + 2  # per layer q, k, v, o, gate, up, down; embedding; head
    embed, head = snapshot.get_input_embeddings(), snapshot.lm_head
    assert head.qweight is embed.qweight, "tied input and output embeddings stay one tensor"
    # the int8 copy holds a byte per weight of a linear layer plus a float per row
    policy_bytes = module_bytes(module.policy.parameters())
    assert module.snapshot.nbytes < 0.3 * policy_bytes
    assert all(not p.requires_grad for p in snapshot.parameters())


def test_bfloat16_snapshot_holds_half_the_bytes_and_keeps_float32_buffers(tiny_model_dir):
    module = make_module(tiny_model_dir, snapshot=SnapshotConfig(dtype="bfloat16"))
    params = list(module.old_policy.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert 2 * module_bytes(iter(params)) == module_bytes(module.policy.parameters())
    assert {b.dtype for b in module.old_policy.buffers()} == {torch.float32}


def test_shared_snapshot_is_the_policy_and_holds_nothing(tiny_model_dir):
    copy = make_module(tiny_model_dir)
    shared = make_module(tiny_model_dir, snapshot=SnapshotConfig(mode="shared"))
    assert shared.old_policy is shared.policy and shared.snapshot.nbytes == 0
    count = sum(p.numel() for p in shared.policy.parameters())
    assert sum(p.numel() for p in shared.parameters()) == count
    assert sum(p.numel() for p in copy.parameters()) == 2 * count
    assert "old_policy" not in dict(shared.named_children())
    assert not any(k.startswith("old_policy.") for k in shared.state_dict())


def test_lora_snapshot_is_adapter_sized(tiny_model_dir):
    module = make_module(tiny_model_dir, lora=LoraConfig(r=4))
    assert "old_policy" not in dict(module.named_children())
    params = dict(module.policy.named_parameters())
    trainable = [p for p in params.values() if p.requires_grad]
    snapshot = [p for n, p in params.items() if ".snapshot." in n]
    base = [p for n, p in params.items() if "lora_" not in n]
    assert trainable and all(".default." in n for n, p in params.items() if p.requires_grad)
    assert sum(p.numel() for p in snapshot) == sum(p.numel() for p in trainable)
    assert module.snapshot.nbytes == module_bytes(iter(trainable))
    assert sum(p.numel() for p in snapshot) < 0.2 * sum(p.numel() for p in base)
    assert module.ref_policy is None, "the reference policy is the base model, not a copy"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "frozen"}, r"snapshot.mode must be one of \['copy', 'shared'\]; got 'frozen'"),
        ({"dtype": "fp8"}, r"snapshot.dtype must be one of \['same', 'bfloat16', 'int8'\]; got"),
        ({"mode": "shared", "dtype": "int8"}, r"snapshot.dtype='int8' needs snapshot.mode='copy'"),
    ],
)
def test_bad_snapshot_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SnapshotConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, r"lora.r must be an integer >= 1; got 0"),
        ({"alpha": 0.0}, r"lora.alpha must be > 0; got 0.0"),
        ({"dropout": 1.0}, r"lora.dropout must be in \[0, 1\); got 1.0"),
        ({"target_modules": []}, r"lora.target_modules must be 'all-linear' or a non-empty list"),
    ],
)
def test_bad_lora_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)


def test_lora_options_that_meet_the_model_fail_before_training(tiny_model_dir):
    with pytest.raises(ValueError, match=r"lora.target_modules=\['no_such_layer'\]"):
        make_module(tiny_model_dir, lora=LoraConfig(target_modules=["no_such_layer"]))
    with pytest.raises(ValueError, match=r"snapshot.dtype='int8' applies to full copies"):
        make_module(tiny_model_dir, lora=LoraConfig(), snapshot=SnapshotConfig(dtype="int8"))


def test_qlora_without_cuda_is_refused_by_name():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: QLoRA is allowed here")
    with pytest.raises(ValueError, match=r"lora.load_in_4bit=true \(QLoRA\) needs a CUDA device"):
        LoraConfig(load_in_4bit=True)


# QLoRA itself (CUDA only) is trained in tests/test_cuda.py.


def test_a_lora_snapshot_and_the_engines_weights_carry_embedding_adapters_too():
    """LoRA on ``embed_tokens`` keeps its adapter in ``lora_embedding_A/B``, whose parameter
    names end in the adapter's name. After the trainable adapter moves and the snapshot
    refreshes, the snapshot's logits are the policy's (before, its embedding adapter kept its
    first weights), and the full weights an engine receives hold the embedding's update (before,
    its base weight alone)."""
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.lora import apply_lora
    from lightning_troll.models.snapshots import AdapterSnapshot
    from lightning_troll.models.weights import full_weights

    policy = apply_lora(
        tiny_causal_lm(20, hidden_size=16, seed=0),
        LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]),
    )
    snapshot = AdapterSnapshot(policy)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name and ".default" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
    snapshot.refresh(policy)
    ids = torch.tensor([[1, 5, 7, 3, 9]])
    with torch.no_grad():
        expected = policy(ids).logits
        with snapshot.behaviour() as behaviour:
            got = behaviour(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    embedding = policy.base_model.model.model.embed_tokens
    delta = embedding.get_delta_weight("default")
    assert delta.abs().max() > 0.01
    weights = dict(full_weights(policy))
    torch.testing.assert_close(
        weights["model.embed_tokens.weight"], embedding.base_layer.weight + delta
    )


def test_a_lora_rank_that_is_not_a_whole_number_is_refused_by_name():
    with pytest.raises(ValueError, match=r"lora.r must be an integer >= 1; got 2.5"):
        LoraConfig(r=2.5)


def embedding_lora_policy():
    """A tiny tied model with LoRA on ``q_proj`` and ``embed_tokens``, its adapters moved."""
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.lora import apply_lora

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"])
    policy = apply_lora(tiny_causal_lm(20, hidden_size=16, seed=0), config)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
    return policy


def test_a_tied_head_keeps_the_embeddings_base_weight_and_tying_engines_are_refused():
    """LoRA on the embedding of a model whose output layer is tied to it: the policy's output
    layer keeps the base weight, which the full weights give as ``lm_head.weight``. A model that
    ties its head to the merged embedding (as vLLM loads a tied model, skipping the head) computes
    other logits, so such engines are refused by name; the HF engine in the trainer's process
    samples from the snapshot itself and is kept."""
    import copy

    from lightning_troll.engines.base import EngineContext
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.lora import apply_lora
    from lightning_troll.models.weights import full_weights, ties_an_adapted_embedding
    from lightning_troll.training.rollout_parts import build_rollout_engine

    policy = embedding_lora_policy()
    assert ties_an_adapted_embedding(policy)
    plain = LoraConfig(r=2, target_modules=["q_proj"])
    assert not ties_an_adapted_embedding(apply_lora(tiny_causal_lm(20, hidden_size=16), plain))
    assert not ties_an_adapted_embedding(tiny_causal_lm(20, hidden_size=16))

    weights = dict(full_weights(policy))
    tied = tiny_causal_lm(20, hidden_size=16, seed=1)
    tied.load_state_dict({k: v for k, v in weights.items() if k != "lm_head.weight"}, strict=False)
    untied = copy.deepcopy(tied)
    untied.lm_head.weight = torch.nn.Parameter(weights["lm_head.weight"].clone())
    ids = torch.tensor([[1, 5, 7, 3, 9]])
    with torch.no_grad():
        expected = policy(ids).logits
        torch.testing.assert_close(untied(ids).logits, expected, rtol=0, atol=1e-5)
        assert (tied(ids).logits - expected).abs().max() > 1e-2

    config = LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"])  # the policy's
    context = EngineContext("unused", "float32", None, config, tied_embedding_adapter=True)
    refused = (
        r"lora.target_modules=\['q_proj', 'embed_tokens'\] puts an adapter on the input "
        r"embedding.*engine.name 'hf'"
    )
    for name, options in (("vllm", None), ("hf", {"process": True})):
        with pytest.raises(ValueError, match=refused):
            build_rollout_engine(name, options, context)
    assert build_rollout_engine("hf", None, context).name == "hf"
