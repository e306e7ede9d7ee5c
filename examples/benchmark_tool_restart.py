"""How long a tool worker takes to be replaced after a call times out.

A tool that sleeps past ``model.episodes.tool_timeout`` is abandoned and its worker killed and
started again; the next call waits for the new worker. This script times, with one worker and a
0.5 s timeout, the first call (the workers' server and the first worker start), then a few rounds
of a call that times out and a quick call after it: the quick call's time is the replacement's.
The main module here imports Lightning, as the ``lightning-troll`` command's does, so that the
figure is the command's.

    .venv/bin/python examples/benchmark_tool_restart.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch  # noqa: F401 - a main module as heavy as the command's

from lightning_troll.tasks.environments import ToolCall, ToolRunner

TOOLS = ["tests.tool_helpers:sleep", "tests.tool_helpers:multiply"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runner = ToolRunner(TOOLS, workers=1, timeout=0.5)
    quick = [ToolCall("multiply", {"a": 6, "b": 7})]
    try:
        start = time.perf_counter()
        runner.run(quick)
        first = time.perf_counter() - start
        replaced = []
        for _ in range(args.rounds):
            (late,) = runner.run([ToolCall("sleep", {"seconds": 30})])
            assert late.error == "timeout", late
            start = time.perf_counter()
            runner.run(quick)
            replaced.append(time.perf_counter() - start)
    finally:
        runner.close()
    print(f"first call (the server and a worker start): {first:.2f} s")
    print(f"a call after a timeout (the worker replaced): "
          f"{', '.join(f'{s * 1000:.0f}' for s in replaced)} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"first_s": first, "replaced_s": replaced}, out)


if __name__ == "__main__":
    main()
