"""The GPU path: tests that need a CUDA device (marked ``cuda``; skipped without one).

``make gpu-check`` (``examples/gpu_check.py``) runs exactly these (``pytest -m cuda``): QLoRA on a
4-bit base, the paged 8-bit AdamW, a bf16-true training step, chunked log-probs against the full
logits, the projection against the float64 reference, and FSDP2 over NCCL on every visible GPU.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.tinymath import build_tokenizer
from lightning_troll.objectives import LossInputs, build_objective
from lightning_troll.rollouts.rollout import behaviour_outputs, linear_head, response_hidden
from lightning_troll.training.module import OptimizationConfig
from lightning_troll.trust_region.projection import TrustRegionProjection, kl_projection, sparsify
from tests import reference
from tests.test_chunking import TEMPERATURE, T, batch, llama, sparse_old
from tests.test_distributed import assert_same_run, launch
from tests.test_projection import (
    assert_compiled_equals_eager,
    peaked_logits,
    random_pair,
    row_kl,
    sparse_case,
)
from tests.test_training import fit, make_module

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
EPS = 0.05

UnionProjection = partial(TrustRegionProjection, support="union")
"""The layer on the union support (the library's default is the official one)."""


def trainable(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def assert_moved(before: dict[str, torch.Tensor], module) -> None:
    after = dict(module.policy.named_parameters())
    moved = max(
        float((after[n].detach().float() - w.to(after[n].device).float()).abs().max())
        for n, w in before.items()
    )
    assert moved > 0, "the optimiser steps changed no trained weight"


def assert_steps_finite_and_bounded(recorder) -> None:
    """Every step's loss is finite and TROLL's KL after projection stays within the bound."""
    steps = [s for rollout in recorder.stats for s in rollout]
    assert steps, "no optimiser step ran"
    for stats in steps:
        assert torch.isfinite(stats.loss)
        assert float(stats.projection.kl_after.max()) <= EPS * (1 + 1e-5)


def test_qlora_trains_adapters_on_a_4bit_base(tmp_path, tiny_model_dir):
    """QLoRA: the base in 4-bit NF4 stays bit-identical, the adapters (in bfloat16 compute)
    train, and the snapshot adapter follows the trained one after the refresh."""
    pytest.importorskip("peft", reason="QLoRA needs peft (pip install 'lightning-troll[lora]')")
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    module = make_module(
        tiny_model_dir,
        lora=LoraConfig(r=4, load_in_4bit=True),
        optimization=OptimizationConfig(minibatch_size=8),
    )
    quantized = [m for m in module.policy.modules() if type(m).__name__ == "Linear4bit"]
    assert quantized, "the base model's linear layers are 4-bit"
    packed = [m.weight.detach().clone() for m in quantized]
    before = trainable(module)
    assert before and all(".default." in n for n in before), "only adapters train"
    _, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module,
                         accelerator="gpu", limit_val_batches=0)  # fmt: skip
    assert_steps_finite_and_bounded(recorder)
    assert_moved(before, module)
    assert all(
        torch.equal(m.weight, w.to(m.weight.device)) for m, w in zip(quantized, packed, strict=True)
    )
    named = dict(module.policy.named_parameters())
    for name in before:  # the last rollout's refresh copied the trained adapter
        assert torch.equal(named[name.replace(".default.", ".snapshot.")], named[name])


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A 2-layer model whose MLP weights hold 64 x 2048 = 131,072 entries: above the 100,000
    from which bitsandbytes pages an optimiser state (and the 4,096 from which it is 8-bit)."""
    path = tmp_path_factory.mktemp("wide_model")
    tokenizer = build_tokenizer()
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
    model = tiny_causal_lm(len(tokenizer), 64, 2, 2, seed=0, intermediate_size=2048, **ids)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_paged_adamw8bit_keeps_8bit_paged_states(tmp_path, wide_model_dir):
    bnb = pytest.importorskip("bitsandbytes", reason="the paged 8-bit AdamW is bitsandbytes'")

    module = make_module(
        wide_model_dir, optimizer=lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-3)
    )
    before = trainable(module)
    trainer, _, recorder = fit(tmp_path, wide_model_dir, max_steps=2, module=module,
                               accelerator="gpu", limit_val_batches=0)  # fmt: skip
    assert_steps_finite_and_bounded(recorder)
    assert_moved(before, module)
    optimizer = trainer.optimizers[0]
    mlp = module.policy.model.layers[0].mlp.up_proj.weight  # (2048, 64)
    state = optimizer.state[mlp]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    assert getattr(state["state1"], "is_paged", False), "a large state lives in paged memory"


def test_bf16_true_training_step(tmp_path, tiny_model_dir):
    """Weights, snapshot and gradients in bfloat16; the cached old log-probs, the projection and
    the loss in float32; the bound holds."""
    module = make_module(tiny_model_dir, dtype="bfloat16")
    before = trainable(module)
    _, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module,
                         accelerator="gpu", precision="bf16-true", limit_val_batches=0)  # fmt: skip
    assert_steps_finite_and_bounded(recorder)
    assert_moved(before, module)
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.old_policy.parameters()} == {torch.bfloat16}
    rollout = recorder.rollouts[0]
    assert rollout.old_logprobs.dtype == torch.float32 and rollout.old_logprobs.is_cuda
    assert rollout.old.logprobs.dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 4, 7])
def test_chunked_behaviour_outputs_equal_the_full_logits_on_cuda(chunk_size):
    model = llama(seed=0).to(CUDA)  # float64
    ids, attention, response = (t.to(CUDA) for t in batch())
    full_logp, full = behaviour_outputs(model, ids, attention, response, TEMPERATURE, sparse_old)
    logp, old = behaviour_outputs(
        model, ids, attention, response, TEMPERATURE, sparse_old, chunk_size
    )
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)  # float32 log-probs
    assert torch.equal(old.indices, full.indices)
    torch.testing.assert_close(old.logprobs, full.logprobs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["troll", "clip"])
def test_chunked_loss_and_gradients_equal_the_full_logits_on_cuda(name):
    policy, behaviour = llama(seed=0).to(CUDA), llama(seed=1).to(CUDA)
    ids, attention, response = (t.to(CUDA) for t in batch())
    old_logprobs, old = behaviour_outputs(behaviour, ids, attention, response, TEMPERATURE,
                                          sparse_old)  # fmt: skip
    advantages = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(1)).double()
    targets = LossInputs(
        tokens=ids[:, -T:],
        mask=response,
        advantages=advantages.to(CUDA),
        old_logprobs=old_logprobs,
        old=old,
    )
    specific = {"eps": 0.0042, "max_tokens": 5, "mass_delta": 1e-3} if name == "troll" else {}
    objective = build_objective(name, aggregation="seq_mean_token_mean", **specific)
    results = []
    for chunk_size in (None, 4):  # None: one chunk of all rows, as the full logits give
        policy.zero_grad(set_to_none=True)
        hidden = response_hidden(policy, ids, attention, T)  # (B, T, H)
        loss, _ = objective.forward_hidden(
            hidden, linear_head(policy), TEMPERATURE, targets, chunk_size=chunk_size
        )
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in policy.parameters()]))
    (loss, grads), (c_loss, c_grads) = results
    torch.testing.assert_close(c_loss, loss, rtol=1e-10, atol=0)
    for c_grad, grad in zip(c_grads, grads, strict=True):
        assert grad.abs().max() > 0
        torch.testing.assert_close(c_grad, grad, rtol=1e-9, atol=1e-12)


def test_chunked_log_probs_at_qwen_vocabulary_in_float32_on_cuda():
    """V = 151,936 in float32: the chunks' (n, V) matmuls may reduce in another order than the
    whole (N, V) one; log-probs near log(V) = 11.9 agree to 1e-5 relative."""
    vocab = 151_936
    model = tiny_causal_lm(vocab, hidden_size=64, num_layers=1, num_heads=2, seed=0).to(CUDA)
    ids, attention, response = (t.to(CUDA) for t in batch(vocab))

    def sparse(rows, tokens):
        return sparsify(rows, max_tokens=64, mass_delta=1e-5, keep=tokens)

    full_logp, full = behaviour_outputs(model, ids, attention, response, 1.0, sparse)
    logp, old = behaviour_outputs(model, ids, attention, response, 1.0, sparse, 4)
    torch.testing.assert_close(logp, full_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old.logprobs, full.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5])
def test_dense_projection_on_cuda_matches_the_float64_reference(eps):
    new, old = random_pair(6, 50)
    expected = reference.dense_projection(new, old, eps)  # float64, on the CPU
    got = kl_projection(new.to(CUDA), old.to(CUDA), eps).cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-8)
    got32 = kl_projection(new.float().to(CUDA), old.float().to(CUDA), eps).cpu().double()
    torch.testing.assert_close(got32, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-8), (torch.float32, 1e-5)])
def test_sparse_projection_on_cuda_matches_the_float64_reference(dtype, atol):
    """The sparse projection on CUDA against the reference's bisection on the lumped support
    (the CPU test of tests/test_projection.py, with the layer on the GPU)."""
    max_tokens, mass_delta, eps = 3, 1e-3, 0.02
    new, old, tokens = sparse_case(max_tokens=max_tokens, mass_delta=mass_delta)
    result = UnionProjection(eps, max_tokens, mass_delta)(
        new.to(CUDA, dtype), old.to(CUDA), tokens.to(CUDA)
    )
    assert (result.eta > 0).any(), "the case projects some rows"
    for i in range(new.shape[0]):
        old_idx = [k for k in old.indices[i].tolist() if k >= 0]
        old_lp = old.logprobs[i, : len(old_idx)].tolist()
        new_top = reference.top_tokens(new[i], max_tokens, mass_delta)
        support = sorted(set(old_idx) | set(new_top) | {int(tokens[i])})
        a, b = reference.lumped_row(new[i], old_idx, old_lp, float(old.tail_logmass[i]), support)
        projected, eta = reference.project_row(a, b, eps)
        t = support.index(int(tokens[i]))
        assert float(result.logprob[i]) == pytest.approx(float(projected[t]), abs=atol)
        assert float(result.kl_after[i]) == pytest.approx(reference.kl(projected, b), abs=atol)


def test_projection_bound_at_qwen_vocabulary_on_cuda():
    """Float32 rows of 151,936 tokens, a few carrying almost all the mass: after the sparse
    projection every token's KL to the old policy is within the bound, and the projected rows
    sit on it; the dense float64 projection of the same rows agrees on the bound."""
    vocab, n = 151_936, 32
    old_logits = peaked_logits(n, vocab, seed=0).to(CUDA)  # (n, V)
    noise = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    new_logits = old_logits + 3 * noise.to(CUDA)
    tokens = old_logits.argmax(-1)
    old = sparsify(old_logits, keep=tokens)
    result = UnionProjection(EPS)(new_logits, old, tokens)
    assert (result.kl_before > EPS).float().mean() > 0.5
    assert (result.kl_after <= EPS * (1 + 1e-4)).all()
    assert (result.kl_after[result.eta > 0] >= EPS * (1 - 1e-3)).all()
    dense = kl_projection(new_logits.double(), old_logits.double(), EPS)  # (n, V)
    kl = row_kl(dense, old_logits.double().log_softmax(-1))  # (n,)
    assert (kl <= EPS * (1 + 1e-4)).all() and kl.max() >= EPS * (1 - 1e-3)


@pytest.mark.parametrize("support", ["union", "official"])
def test_the_default_compiles_the_solver_on_cuda_and_equals_the_eager_one(support):
    """``compile_solver`` 'auto' (the default) compiles the root finder on a GPU, with no fallback
    to the eager steps, and its projected log-probs, eta* and gradients equal the eager layer's
    (float64, where both solve to 1e-12)."""
    from lightning_troll.trust_region import kl_solver

    kl_solver._compiled_steps.cache_clear()
    assert_compiled_equals_eager(support, "auto", CUDA)
    assert kl_solver._compile_failure == [], kl_solver._compile_failure
    assert kl_solver._compiled_steps.cache_info().currsize == 1  # the compiled steps were built


def test_fsdp2_over_nccl_matches_one_cpu_process(tmp_path):
    """FSDP2 (ModelParallelStrategy) over NCCL on every visible GPU (world size 1 or more)
    trains as one CPU process on the same global batch: the same losses, rewards, KL and
    sparsity statistics, and the same weights to float32 rounding of another device."""
    devices = torch.cuda.device_count()
    prompts = str(4 * devices)  # 4 per process, so the global batch is the same in both runs
    single = launch(tmp_path / "cpu", "--micro-batch-size", "3", "--prompts", prompts)
    out = launch(tmp_path / "nccl", "--strategy", "fsdp2", "--accelerator", "gpu",
                 "--devices", str(devices), "--micro-batch-size", "3", "--prompts", prompts)  # fmt: skip
    # loss/total (about -0.08) is the sum of terms of size about 1 (loss/policy -1.13): float32
    # rounding of the GPU's kernels moved it by 1.9e-5 on an H200, while loss/policy agreed to
    # 1.7e-5 relative and the weights to 1.5e-6 (docs/gpu-and-fsdp.md)
    assert_same_run(single, out, weight_atol=2e-5, metric_atol=5e-5)
