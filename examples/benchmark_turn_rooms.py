"""Each turn sampled up to its own episode's room, against every turn of a batch sampled up to
the largest room and each episode cut afterwards: the feedback game's episodes, both ways, side
by side on one model.

    make smollm2
    python examples/benchmark_turn_rooms.py                       # 8 prompts x 8 episodes, 3 repeats
    python examples/benchmark_turn_rooms.py --prompts 2 --group 4 --repeats 1

Both ways run the same episodes' prompts through
:func:`~lightning_troll.rollouts.episodes.run_episodes` with the HF engine, as the game trains
(``examples/feedback_game/task.yaml``: the ``Scored`` environment, its turn limit, token budget
and temperature), each repeat from the same seed, the ways alternating. "largest" is the HF engine
ignoring the request's ``budgets``: it samples every turn up to the largest room of the batch.
Both draw episodes from the same distribution with other random draws, so their episodes differ.
Printed per way, summed over a repeat's episodes (medians over the repeats): the tokens the model
sampled (a row of a decoding step each), the model tokens the episodes kept, the decoding steps
and the seconds; then own rooms over largest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from lightning_troll.models.smollm2 import DEFAULT_DIR

ROOT = Path(__file__).resolve().parents[1]
GAME = ROOT / "examples" / "feedback_game"
CONFIG = yaml.safe_load((GAME / "task.yaml").read_text())
"""The game's config: a rollout's problems and episodes, the turn limit, the budget and the
temperature come from it."""
TASK = CONFIG["model"]
FIGURES = ("sampled", "kept", "steps", "seconds")


def ways() -> dict[str, type]:
    """The two engines: the HF engine, and the same engine ignoring the request's ``budgets``;
    each counts the tokens it samples and its decoding steps."""
    from lightning_troll.engines.hf import HFEngine

    class Counting(HFEngine):
        sampled = steps = 0

        def counted(self, out):
            self.sampled += int(out.response_mask.sum())
            self.steps += out.response_mask.shape[1]
            return out

    class OwnRooms(Counting):
        def generate(self, snapshot, request, recorder=None):
            return self.counted(super().generate(snapshot, request, recorder))

    class Largest(Counting):
        def generate(self, snapshot, request, recorder=None):
            everyone = replace(request, budgets=None)  # each prompt up to the largest room
            return self.counted(super().generate(snapshot, everyone, recorder))

    return {"own rooms": OwnRooms, "largest": Largest}


def run_way(engine_class: type, model, tokenizer, rows: list[dict], args) -> dict[str, float]:
    """Every episode of ``rows`` once with ``engine_class``: its figures."""
    from retry import Scored

    from lightning_troll.engines.base import EngineContext
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.models.loading import stop_token_ids
    from lightning_troll.rollouts.episodes import EpisodeLimits, Stops, run_episodes
    from lightning_troll.rollouts.multiturn import EngineTurns

    engine = engine_class(EngineContext(str(args.model), "float32", tokenizer))
    sampling = SamplingConfig(
        max_new_tokens=args.budget, temperature=TASK["sampling"]["temperature"]
    )
    turns = EngineTurns(engine, model, sampling, tokenizer.pad_token_id)
    limits = EpisodeLimits(max_turns=TASK["episodes"]["max_turns"], max_tokens=args.budget)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        episodes = run_episodes(turns, tokenizer, [Scored() for _ in rows], rows, limits,
                                Stops(stop_token_ids(tokenizer, model)))  # fmt: skip
    seconds = time.perf_counter() - start
    kept = sum(sum(e.mask) for e in episodes)
    return {"sampled": engine.sampled, "kept": kept, "steps": engine.steps, "seconds": seconds}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / DEFAULT_DIR,
                   help="a model folder (default: SmolLM2-135M-Instruct from make smollm2)")  # fmt: skip
    prompts, group = CONFIG["data"]["batch_size"], TASK["group_size"]
    p.add_argument("--prompts", type=int, default=prompts,
                   help=f"problems (default {prompts}, a rollout's)")  # fmt: skip
    p.add_argument("--group", type=int, default=group,
                   help=f"episodes per problem (default {group}, the game's)")  # fmt: skip
    budget = TASK["sampling"]["max_new_tokens"]
    p.add_argument("--budget", type=int, default=budget,
                   help=f"tokens per episode (default {budget}, the game's)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs of each way (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = p.parse_args(argv)
    for option in ("prompts", "group", "budget", "repeats"):
        value = getattr(args, option)
        if value < 1:
            p.error(f"--{option} must be at least 1; got {value}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a model folder (no config.json); make smollm2 "
                "writes SmolLM2-135M-Instruct to models/")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    from lightning_troll.models.loading import load_policy, load_tokenizer

    sys.path.insert(0, str(GAME))
    model = load_policy(str(args.model)).eval()
    tokenizer = load_tokenizer(str(args.model))
    lines = (GAME / "data" / "train.jsonl").read_text().splitlines()[: args.prompts]
    rows = [json.loads(line) for line in lines for _ in range(args.group)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ways()}
    for repeat in range(args.repeats):
        for name, engine_class in ways().items():
            runs[name].append(run_way(engine_class, model, tokenizer, rows, args))
            print(f"repeat {repeat + 1}/{args.repeats}, {name}: {runs[name][-1]}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in got) for k in FIGURES}
               for name, got in runs.items()}  # fmt: skip
    print(f"\n{len(rows)} episodes, medians over {args.repeats} repeat(s)")
    print("| way | tokens sampled | model tokens kept | decoding steps | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, m in medians.items():
        print(f"| {name} | {m['sampled']:.0f} | {m['kept']:.0f} | {m['steps']:.0f} | "
              f"{m['seconds']:.2f} |")  # fmt: skip
    own, largest = medians["own rooms"], medians["largest"]
    ratios = {k: own[k] / largest[k] for k in FIGURES if largest[k]}
    print("own rooms / largest: " + ", ".join(f"{k} x{v:.3f}" for k, v in ratios.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"medians": medians, "ratios": ratios}, indent=1) + "\n")
    return medians


if __name__ == "__main__":
    main()
