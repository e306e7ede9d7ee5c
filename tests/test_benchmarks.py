"""The training-step overhead benchmark runs end to end and refuses bad arguments clearly."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmark_overhead.py"
TINY = ["--hidden", "16", "--layers", "1", "--mlp", "64", "--sequences", "2", "--length", "8"]


@pytest.mark.slow
def test_overhead_benchmark_writes_ratios_and_prints_both_vocabularies(
    tmp_path, capsys, monkeypatch
):
    """The benchmark's main, here (the peak-memory workers, four fresh processes, are the
    script run as a command): the JSON's two ratios are finite and positive, the table has a
    row per vocabulary, the JSON holds the 151,936 row's ratios as printed, and TROLL's cached
    sparse rows project some tokens."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    benchmark = importlib.import_module("benchmark_overhead")
    out = tmp_path / "overhead.json"
    benchmark.main([*TINY, "--warmup", "0", "--repeats", "1", "--json", str(out)])
    ratios = json.loads(out.read_text())
    assert set(ratios) == {"time_ratio", "memory_ratio"}
    for name, value in ratios.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    lines = capsys.readouterr().out.splitlines()
    rows = [row for row in lines if row.startswith("|") and row.split("|")[1].strip().isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["151936", "32000"]
    # the JSON holds the 151,936 row's ratios, as printed (3 decimals)
    cells = [cell.strip() for cell in rows[0].split("|")]
    assert cells[4] == f"x{ratios['time_ratio']:.3f}"
    assert cells[7] == f"x{ratios['memory_ratio']:.3f}"
    # TROLL's cached sparse rows are real: the perturbed policy is projected on some tokens
    projected = float(cells[8].rstrip("%"))
    assert 0 < projected <= 100


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hidden", "0"], "--hidden must be an integer >= 1; got '0'"),
        (["--hidden", "18"], "--hidden must be a multiple of 4; got 18"),
        (["--length", "x"], "--length must be an integer >= 1; got 'x'"),
        (["--warmup", "-1"], "--warmup must be >= 0; got -1"),
        (["--perturb", "nan"], "--perturb must be a finite number >= 0; got nan"),
    ],
)
def test_overhead_benchmark_refuses_bad_arguments(args, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    benchmark = importlib.import_module("benchmark_overhead")
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "| V |" not in captured.out  # refused before any work


def test_a_recording_decoding_step_waits_on_a_gpu_as_often_with_troll_as_without(
    capsys, monkeypatch
):
    """examples/decode_waits.py counts a tiny rollout's host synchronisations: 24 steps. With
    the recorder as on a GPU a step reads its stop flags with the draw's and the recorder's
    checks, once, plus the sequences kept on steps where some end (and the prefill once);
    TROLL's sparse rows add none. As on a CPU (where a read waits for nothing) the recorder
    reads its check of the logits at each step, and the sparse rows three values more."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    waits = importlib.import_module("decode_waits")
    plain = waits.main([])
    gpu, cpu = plain["gpu"], plain["cpu"]
    assert gpu["steps"] == cpu["steps"] == 24
    assert 1.0 < gpu["waits_per_step"] <= 2.0, gpu
    assert cpu["waits"] == gpu["waits"] + 24
    out = capsys.readouterr().out
    assert f"recorder as on a GPU: 24 decoding steps, {gpu['waits']} host waits" in out
    sparse = waits.main(["--sparse"])
    assert sparse["gpu"]["waits"] == gpu["waits"]
    assert sparse["cpu"]["waits"] == cpu["waits"] + 3 * 24
    with pytest.raises(SystemExit):
        waits.main(["--group", "0"])
    assert "--group must be >= 1; got 0" in capsys.readouterr().err


def test_the_decoding_benchmark_times_both_loops_on_the_same_prompts(
    tiny_chat_model_dir, tmp_path, capsys, monkeypatch
):
    """examples/benchmark_decoding.py on a tiny chat model: a row per length and loop, each
    with its runs, their median, the tokens the loops sampled from the same seed (greedy-free,
    so counted, not compared) and the loop's time over the dynamic one's as printed."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    decoding = importlib.import_module("benchmark_decoding")
    out = tmp_path / "decoding.json"
    rows = decoding.main(["--lengths", "3", "5", "--group", "2", "--repeats", "2",
                          "--model-dir", str(tiny_chat_model_dir), "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == rows
    loops = ("dynamic", "static", "static_all_positions")
    assert [(r["new_tokens"], r["loop"]) for r in rows] == [
        (n, loop) for n in (3, 5) for loop in loops
    ]
    for row in rows:
        assert row["sequences"] == 16 and len(row["runs"]) == 2
        assert abs(row["seconds"] - sum(row["runs"]) / 2) <= 0.01  # the median of two
        assert 16 <= row["tokens"] <= 16 * row["new_tokens"]
    for length in (rows[:3], rows[3:]):
        dynamic = length[0]
        for row in length:
            ratio = row["seconds"] / dynamic["seconds"]  # of times rounded to 0.005 s
            slack = ratio * (0.005 / row["seconds"] + 0.005 / dynamic["seconds"]) + 0.001
            assert abs(row["over_dynamic"] - ratio) <= slack
    printed = capsys.readouterr().out
    assert f"over dynamic {rows[1]['over_dynamic']:.3f}" in printed
    with pytest.raises(SystemExit):
        decoding.main(["--group", "0"])
    assert "--group must be >= 1; got 0" in capsys.readouterr().err


def test_the_length_profile_splits_a_decoding_step_and_a_training_pass_by_operator_kind(
    tiny_chat_model_dir, smollm2_dir, tmp_path, capsys, monkeypatch
):
    """examples/profile_lengths.py on a tiny chat model: a row per cache length and per
    training length, each kind's share of the profiled time summing to one; the decoding step
    spends some of it appending to the cache, a training pass none; the cache's bytes are
    SmolLM2's 2.9 MB a position for 64 sequences; the cache's update is unmarked afterwards."""
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicLayer

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    profile = importlib.import_module("profile_lengths")
    update = DynamicLayer.update
    out = tmp_path / "profile.json"
    result = profile.main(["--contexts", "4", "40", "--batch", "3", "--train-lengths", "5", "20",
                           "--repeats", "1", "--model-dir", str(tiny_chat_model_dir),
                           "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert DynamicLayer.update is update
    assert [r["context"] for r in result["decode"]] == [4, 40]
    assert [r["response_tokens"] for r in result["training"]] == [5, 20]
    split = [r[f"{c}_shares"] for r in result["decode"] for c in profile.CACHES]
    for shares in split + [r["shares"] for r in result["training"]]:
        assert set(shares) == set(profile.KINDS)
        assert all(share >= 0 for share in shares.values())
        assert abs(sum(shares.values()) - 1) <= 0.002  # four shares rounded to 0.001
        assert shares["matmul"] > 0
    for row in result["decode"]:
        assert row["sequences"] == 3
        assert row["concatenated_shares"]["cache_append"] > 0  # both caches' updates marked
        assert row["reserved_shares"]["cache_append"] > 0
        ratio = row["reserved_step_s"] / row["concatenated_step_s"]  # of times rounded to 0.1 ms
        slack = ratio * (5e-5 / row["reserved_step_s"] + 5e-5 / row["concatenated_step_s"])
        assert abs(row["reserved_over_concatenated"] - ratio) <= slack + 0.001
    for row in result["training"]:
        assert row["positions"] == 48 + row["response_tokens"] and row["ms_per_token"] > 0
        assert row["shares"]["cache_append"] == 0 and row["page_faults_per_pass"] >= 0
    smollm2 = AutoConfig.from_pretrained(smollm2_dir)  # 30 layers, 3 key-value heads of 64
    assert profile.cache_bytes(smollm2, 64, 1) == 64 * 30 * 2 * 3 * 64 * 4
    with pytest.raises(SystemExit):
        profile.main(["--batch", "0"])
    assert "--batch must be >= 1; got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile.main(["--contexts", "8", "0"])
    assert "--contexts must all be >= 1; got [8, 0]" in capsys.readouterr().err


def test_the_heap_profile_samples_each_way_in_a_fresh_process(
    tiny_chat_model_dir, tmp_path, capsys, monkeypatch
):
    """examples/profile_heap.py on a tiny chat model: one row per way of keeping the record, in
    order, each having sampled every token asked for, its heap's parts within the heap and its
    peak at least its resident memory; the printed lines and the JSON say the same."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    heap = importlib.import_module("profile_heap")
    out = tmp_path / "heap.json"
    rows = heap.main(["--model-dir", str(tiny_chat_model_dir), "--layers", "1",
                      "--new-tokens", "4", "--batch", "16", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == {"layers": 1, "new_tokens": 4, "batch": 16, "rows": rows}
    assert [r["way"] for r in rows] == list(heap.WAYS)
    printed = capsys.readouterr().out
    for row in rows:
        assert row["tokens"] == 16 * 4 and row["seconds"] >= 0
        assert 0 < row["in_use_mib"] <= row["heap_mib"] and 0 <= row["free_mib"] <= row["heap_mib"]
        assert row["in_use_mib"] + row["free_mib"] <= row["heap_mib"] + 0.2  # rounded to 0.1
        assert 0 < row["rss_mib"] <= row["peak_mib"]
        assert f"{row['way']:>13}: heap {row['heap_mib']:8.1f} MiB" in printed
    for bad, message in ((["--batch", "12"], "--batch must be a multiple of 8; got 12"),
                         (["--new-tokens", "0"], "--new-tokens must be >= 1; got 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            heap.main(bad)
        assert message in capsys.readouterr().err


def test_the_grouped_heads_benchmark_times_both_ways_on_the_same_step(tmp_path, monkeypatch):
    """SmolLM2's architecture at 8 and 12 cached positions, 2 sequences: a row per length with
    both ways' medians and their ratio, the logits of the two ways equal to float32 rounding,
    and the record names the transformers it ran on and whether its sdpa copies groups."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    benchmark = importlib.import_module("benchmark_grouped_heads")
    out = tmp_path / "grouped.json"
    benchmark.main(["--lengths", "8", "12", "--sequences", "2", "--repeats", "1",
                    "--json", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    import transformers

    from lightning_troll.engines.step_attention import sdpa_copies_groups

    assert record["transformers"] == transformers.__version__
    assert record["sdpa_copies_groups"] is sdpa_copies_groups()
    assert [row["cached"] for row in record["rows"]] == [8, 12]
    for row in record["rows"]:
        assert row["sequences"] == 2 and row["transformers_ms"] > 0 and row["folded_ms"] > 0
        assert row["ratio"] == pytest.approx(row["folded_ms"] / row["transformers_ms"], abs=2e-3)
        assert row["max_logit_gap"] < 1e-4


def test_the_draw_benchmark_times_both_searches_and_finds_the_same_tokens(tmp_path, monkeypatch):
    """Two vocabularies, 4 rows, one draw each way: a row per vocabulary, the same tokens from
    the same seed, and the ratio of the two medians."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    benchmark = importlib.import_module("benchmark_draw")
    out = tmp_path / "draw.json"
    benchmark.main(["--vocabularies", "100", "3000", "--rows", "4", "--repeats", "1",
                    "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(row["vocabulary"], row["rows"]) for row in rows] == [(100, 4), (3000, 4)]
    for row in rows:
        assert row["same_tokens"] is True and row["two_level_ms"] > 0 and row["one_scan_ms"] > 0
        ratio = row["two_level_ms"] / row["one_scan_ms"]
        assert row["two_level_over_one_scan"] == pytest.approx(ratio, rel=2e-2)
