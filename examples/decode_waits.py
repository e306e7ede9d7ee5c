"""How often the HF engine's decoding loop waits on the device: host synchronisations per step.

On a GPU the decoding loop of a small model is paced by the host (the third GPU report), and
each synchronisation stops the host from queueing the next kernels while the device works. This
counts them on any machine: a profiled rollout of a tiny model (TinyMath's tokenizer, 2 layers),
``--prompts`` x ``--group`` completions of ``--max-new-tokens`` at temperature 1.0 with the
behaviour recorder on: the profiler's ``aten::_local_scalar_dense`` (a value read back to the
host) and ``aten::nonzero`` (an output whose size the host must learn) calls, and the
``Tensor.tolist`` calls (several values read back at once, which the profiler does not show on a
CPU). It counts the recorder as a GPU runs it (``read_free``: its checks read with the loop's,
its sparse rows cut without reads) and as a CPU runs it, where a read waits for nothing.

    python examples/decode_waits.py            # the recorder keeps log-probs (clipping)
    python examples/decode_waits.py --sparse   # and TROLL's sparse rows
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

WAITS = ("aten::_local_scalar_dense", "aten::nonzero")


def count(
    prompts: int,
    group: int,
    max_new_tokens: int,
    sparse: bool = False,
    read_free: bool = True,
    seed: int = 1,
) -> dict[str, float]:
    """One profiled rollout (after an unprofiled warm-up): its decoding steps and host waits;
    ``sparse`` also records TROLL's sparse rows at every step (its defaults); ``read_free`` as
    :class:`~lightning_troll.engines.behaviour.BehaviourRecorder`'s (True: as on a GPU)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.profiler import ProfilerActivity, profile

    from lightning_troll.engines.behaviour import BehaviourRecorder
    from lightning_troll.engines.sampling import SamplingConfig, sample
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.tinymath import build_tokenizer
    from lightning_troll.trust_region import defaults
    from lightning_troll.trust_region.sparse import sparsify

    tokenizer = build_tokenizer()
    model = tiny_causal_lm(len(tokenizer)).eval()
    prompt_ids = [tokenizer.encode(f"{12 + k}+7=") for k in range(prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)

    def rows(logits, tokens, reads=True):
        return sparsify(logits, defaults.MAX_TOKENS, defaults.MASS_DELTA, keep=tokens, reads=reads)

    def rollout():
        recorder = BehaviourRecorder(1.0, rows if sparse else None, read_free=read_free)
        ids, _, mask, _ = sample(model, prompt_ids, group, sampling, tokenizer.pad_token_id,
                                 [tokenizer.eos_token_id], True, recorder)  # fmt: skip
        recorder.finish(ids[:, -mask.shape[1] :])
        return mask

    torch.manual_seed(seed)
    rollout()

    class ToList(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            ToList.calls += func is torch.Tensor.tolist
            return func(*args, **(kwargs or {}))

    torch.manual_seed(seed)
    with profile(activities=[ProfilerActivity.CPU]) as prof, ToList():
        mask = rollout()
    calls = {e.key: e.count for e in prof.key_averages()}
    waits = sum(calls.get(k, 0) for k in WAITS) + ToList.calls
    steps = mask.shape[1]
    return {"steps": steps, "waits": waits, "waits_per_step": round(waits / steps, 2)}


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints and returns the counts of the recorder as on a GPU (``gpu``) and on a CPU
    (``cpu``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--sparse", action="store_true",
                        help="the recorder also keeps TROLL's sparse rows, as a TROLL rollout does")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("prompts", "group", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    results = {}
    for device, read_free in (("gpu", True), ("cpu", False)):
        shape = (args.prompts, args.group, args.max_new_tokens)
        result = results[device] = count(*shape, args.sparse, read_free)
        print(f"recorder as on a {device.upper()}: {result['steps']} decoding steps, "
              f"{result['waits']} host waits, {result['waits_per_step']} a step")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
