"""README.md and docs/*.md stay true to the repository: the README stays short, the pages it
promises exist, every relative link (file and ``#anchor``) resolves, and every option, config,
script and ``make`` target the pages name exists.

Options are checked against the parser of ``lightning-troll fit`` itself (``TrollCLI``'s), built
without parsing a command line, so an option renamed in the code fails here until the pages
follow. Anchors are GitHub's heading slugs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 400
PAGES = (
    "concepts.md",
    "configuration.md",
    "own-task.md",
    "benchmarks.md",
    "gpu-and-fsdp.md",
    "troubleshooting.md",
    "logging-and-export.md",
    "logging.md",
    "rewards.md",
    "api.md",
    "supports.md",
    "architecture.md",
    "engines.md",
)
SECTIONS = (
    "model",
    "data",
    "trainer",
    "rollout",
    "old_policy",
    "trust_region_monitor",
    "sparsity_monitor",
    "constraint_monitor",
    "release_memory",
    "checkpoint",
)
MODEL_GROUPS = (
    "trust_region",
    "clip",
    "loss",
    "optimization",
    "sampling",
    "snapshot",
    "lora",
    "reward_options",
)
FILE_SUFFIXES = (".py", ".yaml", ".json", ".jsonl", ".md", ".ckpt", ".png", ".csv", ".gguf")


# -- reading Markdown ------------------------------------------------------------------------


def documents() -> list[Path]:
    """The README, the docs and the studies' pages (their index, plans and results)."""
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "studies").glob("*.md"))]


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``text`` with its fenced code blocks blanked (line numbers kept), and the blocks as
    ``(language, body)``."""
    prose, blocks, block, language = [], [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block, language = [], line.strip()[3:].strip()
            else:
                blocks.append((language, "\n".join(block)))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert block is None, "an unclosed code fence"
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
    """The backtick spans of ``prose``, paragraph by paragraph (a span may wrap lines)."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", prose):
        spans += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", paragraph)]
    return spans


def command_lines(path: Path) -> list[str]:
    """Shell lines of the page: its bash code blocks (continuations joined, comments dropped)
    and its backtick spans."""
    prose, blocks = split_fences(path.read_text())
    lines = []
    for language, body in blocks:
        if language in ("bash", "sh", "shell", ""):
            for line in body.replace("\\\n", " ").splitlines():
                lines.append(line.split(" #", 1)[0].strip())
    return lines + inline_code(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text())
    found, counts = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, flags=re.M):
        base = slug(heading)
        count = counts.get(base, 0)
        counts[base] = count + 1
        found.add(f"{base}-{count}" if count else base)  # GitHub numbers repeated headings
    return found


def links(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text())
    prose = re.sub(r"`[^`]*`", "", prose)
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def link_problem(page: Path, target: str) -> str | None:
    """Why ``target``, a link on ``page``, does not resolve (None when it does)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not resolved.exists():
        return f"{target}: no such file"
    if anchor:
        if resolved.suffix != ".md":
            return f"{target}: an anchor into a file that is not Markdown"
        if anchor not in anchors(resolved):
            return f"{target}: no heading of {resolved.relative_to(ROOT)} has this anchor"
    return None


# -- the CLI's options -----------------------------------------------------------------------


class _ParserBuilt(Exception):
    pass


@pytest.fixture(scope="module")
def fit_options() -> dict[str, argparse.Action]:
    """Option string -> action of ``lightning-troll fit``: the parser that ``lightning_troll.cli.command``
    builds, stopped before it parses anything (no model is loaded)."""
    from lightning_troll.cli.command import TRAINER_DEFAULTS, TrollCLI
    from lightning_troll.tasks.data.datamodule import PromptDataModule
    from lightning_troll.training.module import TrollModule

    class ParserOnly(TrollCLI):
        def parse_arguments(self, parser, args) -> None:
            raise _ParserBuilt(self)

    with pytest.raises(_ParserBuilt) as built:
        ParserOnly(
            TrollModule,
            PromptDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            auto_configure_optimizers=False,
            args=[],
        )
    return dict(built.value.args[0]._subcommand_parsers["fit"]._option_string_actions)


def _members(hint: object) -> list[object]:
    """The types of a Union (None left out), or the type itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [h for h in typing.get_args(hint) if h is not type(None)]
    return [hint]


def _nested_problem(name: str, hint: object, rest: list[str]) -> str | None:
    """Why ``rest`` is no key under an option of type ``hint`` (None when it is one)."""
    if not rest:
        return None
    for member in _members(hint):
        origin = typing.get_origin(member) or member
        if origin is dict or member is typing.Any:
            return None  # any key: reward names, init_args of a class
        if dataclasses.is_dataclass(member):
            fields = {field.name for field in dataclasses.fields(member)}
            if rest[0] in fields:
                field_hint = typing.get_type_hints(member)[rest[0]]
                return _nested_problem(name, field_hint, rest[1:])
        is_callable = origin is Callable or getattr(origin, "__name__", "") == "Callable"
        is_class = isinstance(origin, type) and origin not in (str, int, float, bool, list)
        if (is_callable or is_class) and rest[0] in ("class_path", "init_args"):
            return None
    return f"{name}: {'.'.join(rest)} is not a key of an option of type {hint}"


def option_problem(options: dict[str, argparse.Action], name: str) -> str | None:
    """Why ``name`` (``model.trust_region.eps``, no dashes) is no option of ``lightning-troll
    fit`` (None when it is one). Keys below a dict, dataclass or class option are checked
    against its type."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        action = options.get("--" + ".".join(parts[:i]))
        if i == len(parts) and type(action).__name__ == "_ActionHelpClassPath":
            return None  # --model.episodes.help: the help of an optional record's fields
        if action is None or type(action).__name__ in ("_HelpAction", "_ActionHelpClassPath"):
            continue
        hint = getattr(action, "_typehint", None)
        if i < len(parts) and hint is None:
            return f"{name}: --{'.'.join(parts[:i])} has no option {parts[i]}"
        return _nested_problem(name, hint, parts[i:])
    return f"{name}: no such option of lightning-troll fit"


def documented_options(path: Path) -> list[str]:
    """Every option the page names: ``--section.key`` anywhere in its commands, ``section.key``
    and ``group.key`` (short for ``model.group.key``) in backticks, the keys of its YAML blocks,
    and the bare keys a table row lists beside its option group."""
    sections = "|".join(SECTIONS)
    # not a call such as TRL's `trainer.save_model(output_dir)`
    dotted = rf"(?<![\w./-])(?:--)?((?:{sections})(?:\.[A-Za-z_]\w*)+)(?![\w(])"
    short = rf"(?<![\w./-])((?:{'|'.join(MODEL_GROUPS)})(?:\.[A-Za-z_]\w*)+)(?![\w(])"
    found = []
    for line in command_lines(path):
        found += re.findall(dotted, line)
        found += ["model." + s for s in re.findall(short, line)]
    prose, blocks = split_fences(path.read_text())
    for language, body in blocks:
        if language == "yaml":
            found += _flatten(yaml.safe_load(body))
    for row in re.findall(r"^\|(.*)\|\s*$", prose, flags=re.M):
        # a table row of an option group, `model.trust_region`, lists its keys bare: `eps`
        cells = [cell.strip() for cell in row.split("|")]
        group = re.fullmatch(rf"`((?:{sections})\.\w+)`", cells[0])
        if group and len(cells) >= 3:
            found += [f"{group[1]}.{key}" for key in re.findall(r"`([a-z_]\w*)`", cells[2])]
    return [name for name in found if not name.endswith(FILE_SUFFIXES)]


def _flatten(config: object, prefix: str = "") -> list[str]:
    if not isinstance(config, dict):
        return [prefix] if prefix else []
    keys = [] if not prefix else [prefix]
    for key, value in config.items():
        keys += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return keys


def cli_problems(options: dict[str, argparse.Action], line: str) -> list[str]:
    """Flags of ``lightning-troll fit|validate`` or ``export`` on ``line`` that it lacks."""
    from lightning_troll.cli.export import parse_args

    found = re.search(r"lightning-troll (fit|validate|export)\b(.*)", line)
    if not found:
        return []
    command, rest = found.groups()
    flags = re.findall(r"(?<![\w-])(--[a-z_]+)(?![\w.])", rest)
    known = _export_flags(parse_args) if command == "export" else set(options) | {"--debug"}
    return [
        f"{line}: lightning-troll {command} has no {flag}" for flag in flags if flag not in known
    ]


def _export_flags(parse_args: Callable) -> set[str]:
    """The flags ``lightning-troll export`` parses: its parser, read off an ``--help``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    return set(re.findall(r"(--[a-z_]+)", out.getvalue()))


# -- the tests -------------------------------------------------------------------------------


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


@pytest.mark.parametrize("page", PAGES)
def test_every_docs_page_exists_and_the_readme_links_it(page):
    assert (DOCS / page).is_file(), f"docs/{page} is missing"
    assert f"](docs/{page})" in README.read_text(), f"the README's reading list lacks docs/{page}"


def test_the_readme_links_the_studies_index_and_the_index_every_study_page():
    """The studies live apart from the library (``studies/``); their index names every page."""
    assert "](studies/README.md)" in README.read_text()
    index = (ROOT / "studies" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "studies").glob("*.md") if p.name != "README.md")
    missing = [page for page in pages if f"]({page}" not in index]
    assert pages and not missing, f"studies/README.md does not link {missing}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    found = links(path)
    problems = [p for p in (link_problem(path, t) for t in found) if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_every_option_named_is_an_option_of_the_cli(path, fit_options):
    """Every option a page names is one the command takes; a study's pages record the names its
    runs were given, so there an option renamed since counts under its name now."""
    names = documented_options(path)
    if path.parent.name == "studies":
        names = [_renamed(n) for n in names]
    problems = [option_problem(fit_options, n) for n in names]
    problems += [p for line in command_lines(path) for p in cli_problems(fit_options, line)]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def _renamed(name: str) -> str:
    """``name`` (``model.loss.anchor``) under its name now (``model.corrections.anchor``)."""
    from lightning_troll.training.moved import RENAMED_OPTIONS

    old = name.removeprefix("model.")
    return (
        f"model.{RENAMED_OPTIONS[old]}"
        if name.startswith("model.") and old in RENAMED_OPTIONS
        else name
    )


def _script_flags(script: Path) -> set[str]:
    """The flags written in ``script`` and in the modules beside it that it imports (a study
    script takes shared flags from a helper such as ``paper_regime_study.add_objectives``)."""
    source = script.read_text()
    imported = re.findall(r"^(?:import|from)\s+(\w+)", source, re.MULTILINE)
    for module in (script.parent / f"{name}.py" for name in imported):
        if module.is_file() and module != script:
            source += module.read_text()
    flags = set(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", source))
    return flags | {"--no-" + f[2:] for f in flags}  # argparse.BooleanOptionalAction


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_every_config_script_and_flag_named_exists(path, fit_options):
    """``configs/*.yaml``, ``examples/*.py`` and ``tests/*.py`` paths exist, and the flags given
    to an example script on the same line are flags of that script; those after a lone ``--``,
    which a study script passes on to every fit, are ``lightning-troll fit``'s (a dotted one,
    ``--old_policy.max_staleness``, is checked with the page's other options)."""
    problems = []
    text = path.read_text()
    pattern = r"(?<![\w./-])((?:configs|examples|studies|tests)/[\w./-]+\.(?:py|yaml))\b"
    for name in sorted(set(re.findall(pattern, text))):
        if not (ROOT / name).is_file():
            problems.append(f"{name}: no such file")
    for line in command_lines(path):
        for script, rest in re.findall(r"((?:examples|studies)/\w+\.py)((?:\s+[^|;&]*)?)", line):
            if not (ROOT / script).is_file():
                continue
            known = _script_flags(ROOT / script)
            own, *passed = re.split(r"\s--(?=\s|$)", rest, maxsplit=1)
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", own):
                if flag not in known:
                    problems.append(f"{line}: {script} has no {flag}")
            for flag in re.findall(r"(?<![\w-])(--[a-z_]+)(?![\w.])", "".join(passed)):
                if flag not in fit_options:
                    problems.append(f"{line}: lightning-troll fit has no {flag} (after --)")
    assert not problems, "\n".join(problems)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, flags=re.M))


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_every_make_target_named_exists(path):
    targets = make_targets()
    named = [
        t for line in command_lines(path) for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", line)
    ]
    missing = sorted(set(named) - targets)
    assert not missing, f"{path.name} names make targets the Makefile lacks: {missing}"


# -- the checks themselves can fail ----------------------------------------------------------


def test_the_link_check_catches_a_broken_file_or_anchor():
    page = DOCS / "concepts.md"
    assert link_problem(page, "benchmarks.md") is None
    assert link_problem(page, "../README.md#install") is None
    assert link_problem(page, "no-such-page.md") is not None
    assert link_problem(page, "benchmarks.md#no-such-heading") is not None
    assert link_problem(page, "../configs/tinymath.yaml#x") is not None


def test_anchors_follow_githubs_slugs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n## SmolLM2-135M-Instruct: TROLL against clipping\n## One GRPO iteration, "
        "against TRL\n### `make gpu-check`\n## Top\n```bash\n# not a heading\n```\n"
    )
    assert anchors(page) == {
        "top",
        "smollm2-135m-instruct-troll-against-clipping",
        "one-grpo-iteration-against-trl",
        "make-gpu-check",
        "top-1",
    }


def test_the_option_check_catches_a_made_up_option(fit_options):
    for real in (
        "model.trust_region.eps",
        "model.optimizer.init_args.lr",
        "model.rewards.tinymath",
        "model.lora.load_in_4bit",
        "trainer.strategy.init_args.data_parallel_size",
        "checkpoint.every_n_rollouts",
    ):
        assert option_problem(fit_options, real) is None, real
    for made_up in (
        "model.trust_region.epsilon",
        "model.made_up",
        "data.batchsize",
        "model.lora.rank",
        "model.group_size.x",
        "model.optimizer.lr",
        "rollouts.log_samples",
    ):
        assert option_problem(fit_options, made_up) is not None, made_up
    assert cli_problems(fit_options, "lightning-troll fit --config a.yaml --ckpt_paht x")
    assert cli_problems(fit_options, "lightning-troll export --ckpt_path x --out y")
    assert not cli_problems(fit_options, "lightning-troll export --ckpt_path x --output_dir y")
