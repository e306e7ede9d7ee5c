"""The paper-regime study's tables and plots, from its records (``examples/paper_regime_study.py``;
``examples/unseen_task_check.py`` reports in the same format).

A record is a finished run's (:mod:`study_kit`): its ``fields`` (objective, lr, seed, and
``support``, ``cause`` or ``steps`` where a run changes them) and its ``history`` per rollout.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_kit import TIME, mean_std, plot_curves, run_mean, values  # noqa: E402

ACCURACY, REWARD = "val/accuracy", "reward/mean"
ACTIVE = {"troll": "trust_region/active_frac", "clip": "clip/active_frac"}
"""The share of tokens each objective's constraint acts on (TROLL: projected; clipping: clipped)."""
PLOTS = (
    (ACCURACY, "held-out accuracy", "accuracy", None),
    (REWARD, "mean reward", "reward", None),
    ("entropy", "entropy", "entropy", None),
    ("trust_region/kl_end_mean", "KL(new || old) at the rollout's end", "kl_end", 0.05),
)
"""(metric, label, file name, bound) of each plot of :func:`plot_arms`."""


def pilot_score(record: dict) -> float:
    """Held-out accuracy of a pilot: the mean of its last 2 validations."""
    return statistics.fmean(values(record, ACCURACY)[-2:])


def active_share(record: dict) -> float:
    """The mean share of tokens the run's constraint acted on, over its rollouts."""
    return run_mean(record, ACTIVE[record["fields"]["objective"]]) or 0.0


def pilot_table(pilots: Sequence[dict]) -> str:
    lines = [
        "| objective | lr | held-out accuracy (last 2 validations) | constraint acts on | "
        "KL end, mean | reward, last 5 rollouts |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(pilots, key=lambda r: (r["fields"]["objective"], r["fields"]["lr"])):
        f = r["fields"]
        kl = run_mean(r, "trust_region/kl_end_mean")
        lines.append(
            f"| {f['objective']} | {f['lr']:g} | {pilot_score(r):.3f} | {active_share(r):.2%} | "
            f"{kl if kl is not None else float('nan'):.4f} | {run_mean(r, REWARD, 5):.3f} |"
        )
    return "\n".join(lines) + "\n"


def support(fields: dict) -> str:
    """The support a run's projection used: ``-`` for clipping, which projects nothing. A main run
    names it in ``support``, a cause test in ``cause``."""
    if fields["objective"] == "clip":
        return "-"
    return "dense" if "dense" in (fields.get("support"), fields.get("cause")) else "official"


def cause_table(causes: Sequence[dict], pilots: Sequence[dict], lr: float, steps: int) -> str:
    """The cause tests beside the pilots they change, at ``lr`` (accuracy: last 2 validations)."""
    lines = [
        "| run | objective | steps per rollout | support | held-out accuracy | entropy at rollout "
        "5 | entropy, last 5 | constraint acts on | KL end, mean |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    same = sorted((r for r in pilots if r["fields"]["lr"] == lr), key=lambda r: r["name"])
    for r in same + list(causes):
        f, entropy, nan = r["fields"], values(r, "entropy"), float("nan")
        kl = run_mean(r, "trust_region/kl_end_mean")
        lines.append(
            f"| {r['name']} | {f['objective']} | {f.get('steps', steps)} | "
            f"{support(f)} | {pilot_score(r):.3f} | "
            f"{entropy[4] if len(entropy) > 4 else nan:.2f} | {run_mean(r, 'entropy', 5) or nan:.2f}"
            f" | {active_share(r):.2%} | {kl if kl is not None else nan:.4f} |"
        )
    return "\n".join(lines) + "\n"


def arm(record: dict) -> str:
    f = record["fields"]
    return f"{f['objective']}{' dense' if support(f) == 'dense' else ''} lr {f['lr']:g}"


def by_arm(records: Sequence[dict]) -> dict[str, list[dict]]:
    """``records`` grouped by :func:`arm`, in the order the arms first appear."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(arm(r), []).append(r)
    return groups


EARLY = 20
"""The main table's early accuracy averages the validations after training starts, to this rollout."""


def early_accuracy(record: dict, until: int = EARLY) -> float:
    """The mean held-out accuracy of the validations at rollouts 1 to ``until``."""
    found = [r[ACCURACY] for r in record["history"] if ACCURACY in r and 0 < r["rollout"] <= until]
    return statistics.fmean(found) if found else float("nan")


def main_table(records: Sequence[dict]) -> str:
    lines = [
        f"| arm | seeds | late accuracy (last 3 validations), per seed | mean ± std | early "
        f"accuracy (rollouts 1-{EARLY}) | reward, last 10 | entropy, last 10 | KL end mean / "
        "largest | constraint acts on | median s / rollout |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for name, runs in by_arm(records).items():
        late = [statistics.fmean(values(r, ACCURACY)[-3:]) for r in runs]
        mean, std = mean_std(late)
        early = mean_std([early_accuracy(r) for r in runs])[0]
        kl = mean_std([run_mean(r, "trust_region/kl_end_mean") or 0.0 for r in runs])[0]
        kl_max = max(max(values(r, "trust_region/kl_end_max") or [0.0]) for r in runs)
        seconds = statistics.median(t for r in runs for t in values(r, TIME))
        lines.append(
            f"| {name} | {len(runs)} | {', '.join(f'{x:.3f}' for x in late)} | {mean:.3f} ± "
            f"{std:.3f} | {early:.3f} | {mean_std([run_mean(r, REWARD, 10) for r in runs])[0]:.3f} | "
            f"{mean_std([run_mean(r, 'entropy', 10) for r in runs])[0]:.3f} | {kl:.4f} / "
            f"{kl_max:.2f} | {mean_std([active_share(r) for r in runs])[0]:.2%} | {seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_arms(records: Sequence[dict], folder: Path, plots=PLOTS) -> None:
    """A PNG per plot of ``plots`` in ``folder``: each arm's curve (the mean over its seeds)."""
    groups = by_arm(records)
    for metric, label, name, bound in plots:
        print(f"wrote {plot_curves(groups, metric, label, folder / f'{name}.png', bound)}")
