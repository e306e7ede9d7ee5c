"""The eighth GPU report's second call (``examples/results/gpu/eighth/``), as it ran from the
repository's root on the device: ``python diag.py profile`` writes a kernel table of graph
decoding at the Qwen3-0.6B shape (64 sequences, 1 and 65 new tokens, under the profiler) to
``$OUT/profile_<tokens>.txt``; ``python diag.py rest`` writes the generation phase's rows of the
1.7B and 4B shapes (``examples/gpu_generation.py``) to ``$OUT/generation_rest.json`` after each
shape. The first call's generation phase had run out of its time after the 0.6B shape."""

import json
import os
import sys
import time

sys.path.insert(0, "examples")
import torch  # noqa: E402
from gpu_generation import GenerationSetting, generation_rows, sample_with  # noqa: E402
from gpu_models import QWEN3, qwen3  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

out = os.environ["OUT"]
what = sys.argv[1]
if what == "profile":
    shape = QWEN3["qwen3-0.6b"]
    snapshot = qwen3(shape).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shape.vocab, (8, 64), generator=g).tolist()
    sample_with(snapshot, prompts, 8, 16, "graphs")
    for tokens in (1, 65):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sample_with(snapshot, prompts, 8, tokens, "graphs")
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        with open(f"{out}/profile_{tokens}.txt", "w") as f:
            f.write(f"wall {wall:.4f} s\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            f.write("\n\nby CPU time\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        print(tokens, "wall", round(wall, 3), flush=True)
else:
    rows = []
    for name in ("qwen3-1.7b", "qwen3-4b"):
        t = time.perf_counter()
        setting = GenerationSetting()
        rows += [{"shape": name, **r} for r in generation_rows(name, QWEN3[name], setting, 8)]
        print(name, round(time.perf_counter() - t, 1), rows[-2:], flush=True)
        with open(f"{out}/generation_rest.json", "w") as f:
            json.dump(rows, f, indent=1)
        torch.cuda.empty_cache()
