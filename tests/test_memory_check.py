"""The memory a run needs, estimated before its first rollout: the parts by hand, a start that
cannot fit refused in one line before any sampling, and one that may not fit warned about."""

from __future__ import annotations

import pytest
import torch

import lightning_troll.training.memory_check as memory_check
from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.rollouts.micro_batches import resolve_tokens
from lightning_troll.training.memory_check import GIB, check_fits, estimate
from tests.conftest import refused_here
from tests.test_faults import fit_args


def test_the_parts_by_hand():
    """A tiny Llama: 2 layers, hidden 16, 2 heads of 8 (kv heads 2), MLP width 64, float32.
    KV cache: 6 sequences x 10 positions x 2 layers x 2 (keys, values) x 2 heads x 8 x 4 bytes
    = 15,360; activations: 100 tokens x 2 layers x (16 x 16 + 4 x 64) x 4 = 409,600."""
    model = tiny_causal_lm(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2).train()
    weights = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    parts = estimate(model, model, 6, 10, 100, [torch.optim.AdamW(model.parameters())])
    assert parts == {
        "weights": weights + buffers,
        "gradients": weights,
        "optimiser": 2 * weights,
        "kv_cache": 15360,
        "activations": 409600,
        "sparse_rows": 0,
    }
    kept = estimate(model, model, 6, 10, 100, [], response_tokens=42, sparse_columns=257)
    assert kept["sparse_rows"] == 42 * (257 * (8 + 4) + 4)  # int64 index, float32 log-prob, tail
    no_adam = estimate(model, model, 6, 10, 100, [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert no_adam["optimiser"] == 0
    assert estimate(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), 6, 10, 100, []) is None


def test_the_cli_refuses_a_run_that_cannot_fit_in_one_line_before_sampling(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """With 1 KiB said to be available the tiny model's weights alone do not fit: exit status 2,
    one line of its own that names the options, no traceback, and no rollout sampled (no checkpoint written)."""
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 2**10)
    err = refused_here(fit_args(tmp_path, tiny_model_dir, 1), tmp_path, monkeypatch, capsys)
    lines = [
        line
        for line in err.splitlines()
        if line.startswith("lightning-troll:") and "lightning-troll: warning:" not in line
    ]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lightning-troll: error: this run needs at least")
    assert "and cpu has 0.0 GiB" in lines[0] and "model.sampling.max_new_tokens" in lines[0]
    assert not (tmp_path / "ckpt").exists()


def test_a_floor_that_fits_with_activations_that_may_not_warns(tiny_model_dir, monkeypatch):
    """Available memory between the floor and the floor plus activations: a warning that names
    micro_batch_tokens; above both, nothing."""
    from tests.test_training import make_module

    module = make_module(tiny_model_dir)
    micro = resolve_tokens("auto", module.policy)  # the default
    parts = estimate(module, module.policy, 4 * 4, 64 + 4, micro, [])
    floor = sum(v for k, v in parts.items() if k != "activations")
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: floor + 1)
    with pytest.warns(UserWarning, match=rf"may not fit.*micro_batch_tokens \({micro}\)"):
        check_fits(module, 4, 64)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: floor - 1)
    with pytest.raises(ValueError, match=r"needs at least .* GiB before any activation"):
        check_fits(module, 4, 64)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 64 * GIB)
    check_fits(module, 4, 64)  # fits: no warning (warnings are errors in this suite's filter)


def test_troll_s_sparse_rows_are_counted_beside_the_activations(tiny_model_dir, monkeypatch):
    """A TROLL run keeps its rollout's sparse rows: 4 x 4 sequences x 4 new tokens at the
    trust region's max_tokens + 1 columns. Memory between the floor plus activations and that
    plus the rows warns and names max_tokens; clipping without a monitor keeps none."""
    from tests.test_training import make_module

    module = make_module(tiny_model_dir)  # 4 new tokens
    assert module.cache_old_distributions
    micro = resolve_tokens("auto", module.policy)
    rule = module.old_rows.rule
    columns = rule.max_tokens + 1
    parts = estimate(module, module.policy, 16, 64 + 4, micro, [], 16 * 4, columns)
    assert parts["sparse_rows"] == 16 * 4 * (columns * 12 + 4) > 0
    floor = sum(v for k, v in parts.items() if k not in ("activations", "sparse_rows"))
    monkeypatch.setattr(memory_check, "available_bytes",
                        lambda device: floor + parts["activations"] + 1)  # fmt: skip
    with pytest.warns(UserWarning, match=rf"model.trust_region.max_tokens \({rule.max_tokens}\)"):
        check_fits(module, 4, 64)
    clipping = make_module(tiny_model_dir, objective="clip")
    assert not clipping.cache_old_distributions
    check_fits(clipping, 4, 64)  # no rows kept: fits (warnings are errors in this suite)


def test_the_memory_available_is_read_on_this_machine():
    available = memory_check.available_bytes(torch.device("cpu"))
    assert available is not None and available > 2**20
