"""Profile: the C library's heap after a rollout's sampling on a CPU, the behaviour record kept two
ways.

While it samples, the decoding loop records per step what the loss needs (the sampled tokens'
log-probs and, for TROLL, the sparse rows; ``lightning_troll.engines.behaviour``). This samples
``--new-tokens`` tokens for ``--batch`` sequences (8 prompts of 48 random tokens, repeated for
their group) through that loop and recorder with the library's sparse defaults, on SmolLM2-135M-
Instruct's architecture cut to ``--layers`` layers (random weights, float32, the vocabulary
whole), once each way, each in a fresh process:

- ``blocks``: the recorder as it is, each step's record copied into a few large blocks;
- ``as_they_come``: each step's record kept as the step made it (the blocks switched off).

Per way: glibc's heap (``mallinfo2``: its size, the part in use, the part free but held, and the
bytes in mappings of their own), the resident memory after sampling, the process's peak, and
the seconds sampling took. Linux with glibc only. ::

    python examples/profile_heap.py --json examples/results/smollm2/heap.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

from peak_memory import status_mib

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("blocks", "as_they_come")
GROUP = 8  # completions per prompt
PROMPT_TOKENS = 48


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def heap() -> dict:
    """glibc's heap now, in MiB: its size, in use, free (held), in mappings of their own."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    mib = 2**20
    return {
        "heap_mib": round(info.arena / mib, 1),
        "in_use_mib": round(info.uordblks / mib, 1),
        "free_mib": round(info.fordblks / mib, 1),
        "mapped_mib": round(info.hblkhd / mib, 1),
    }


def resident() -> dict:
    """The process's resident memory now and at its peak, in MiB."""
    return {"rss_mib": round(status_mib("VmRSS"), 1), "peak_mib": round(status_mib("VmHWM"), 1)}


def worker(way: str, model_dir: Path, layers: int, new_tokens: int, batch: int) -> dict:
    """One sampling run, the record kept ``way``, in this process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_troll.engines.behaviour as behaviour
    import lightning_troll.engines.records as records
    from lightning_troll.engines.decode import decode
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.trust_region import defaults
    from lightning_troll.trust_region.sparse import sparsify

    if way == "as_they_come":
        records.Store.keep = lambda self, values: values
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = torch.randint(10, config.vocab_size, (batch // GROUP, PROMPT_TOKENS))

    def sparse_rows(logits, tokens, reads=True):
        return sparsify(logits, defaults.MAX_TOKENS, defaults.MASS_DELTA, keep=tokens, reads=reads)

    recorder = behaviour.BehaviourRecorder(1.0, sparse_rows)
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    start = time.perf_counter()
    responses = decode(model, prompts, torch.ones_like(prompts), GROUP, sampling, 0, [-1],
                       recorder=recorder)  # fmt: skip
    seconds = time.perf_counter() - start
    return {"way": way, "tokens": int(responses.numel()), "seconds": round(seconds, 1),
            **heap(), **resident()}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct",
                        help="a model folder whose config is used (random weights)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept")
    parser.add_argument("--new-tokens", type=int, default=300, help="tokens each sequence samples")
    parser.add_argument("--batch", type=int, default=64,
                        help=f"sequences, a multiple of {GROUP} (prompts x {GROUP})")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("layers", "new_tokens", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.batch % GROUP:
        parser.error(f"--batch must be a multiple of {GROUP}; got {args.batch}")
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        parser.error("this profile reads glibc's mallinfo2, which this C library lacks")
    if args.worker:
        print(json.dumps(worker(args.worker, args.model_dir, args.layers, args.new_tokens,
                                args.batch)))  # fmt: skip
        return []
    rows = []
    for way in WAYS:
        command = [sys.executable, __file__, "--worker", way, "--model-dir", str(args.model_dir),
                   "--layers", str(args.layers), "--new-tokens", str(args.new_tokens),
                   "--batch", str(args.batch)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"the {way} run failed:\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{way:>13}: heap {row['heap_mib']:8.1f} MiB, in use {row['in_use_mib']:7.1f}, "
              f"free {row['free_mib']:8.1f}, mapped {row['mapped_mib']:7.1f}; resident "
              f"{row['rss_mib']:8.1f} MiB, peak {row['peak_mib']:8.1f}; {row['seconds']} s")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"layers": args.layers, "new_tokens": args.new_tokens,
                                         "batch": args.batch, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
