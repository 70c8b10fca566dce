"""The documentation as a new user meets it: every link and every repository path named in the
README, docs/ and the benchmark results resolves, every `vapo` command they show parses with
the real CLI, and none of them tells the project's work history."""

import contextlib
import glob
import io
import itertools
import re
import shlex
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from tests.helpers import CONFIGS, ROOT, config_chain
from vapo_lightning.cli import main

RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "tests" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "RESULTS.md",
        ROOT / "benchmarks" / "probes" / "README.md",
        *RESULTS.glob("*.md"),
        *(ROOT / "vapo_lightning" / "assets").glob("*/README.md"),
    ]
)
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
USER_PAGES = [p for p in PAGES if p.parent != RESULTS]  # what a user reads first

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
REPO_DIRS = (
    "benchmarks",
    "examples",
    "configs",
    "docs",
    "scripts",
    "tests",
    "vapo_lightning",
    ".ci",
)
DIRS = "|".join(re.escape(d) for d in REPO_DIRS)
PATH = re.compile(rf"(?<![\w./-])((?:{DIRS})/[\w.*{{}},/-]*[\w*}}/])")
RESULT_FILE = re.compile(r"(?<![\w./-])((?:results/)?[\w*]+\.(?:md|png))(?![\w/])")
GENERATED = ("benchmarks/.venvs",)  # made by a command, not shipped


def expand(pattern: str) -> list[str]:
    """`a/{x,y}.md` -> [`a/x.md`, `a/y.md`] (one level of braces, as the docs write them)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def exists(base: Path, path: str) -> bool:
    return all(glob.glob(str(base / p)) for p in expand(path))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (an underscore inside a
    word, as in `min_isolation`, is kept), spaces to hyphens."""
    markup = r"[`*]|(?<!\w)_|_(?!\w)|\[([^\]]*)\]\([^)]*\)"
    text = re.sub(markup, lambda m: m.group(1) or "", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_repository_path_exists(page):
    text = page.read_text()
    spans = CODE_SPAN.findall(FENCE.sub("", text)) + FENCE.findall(text)
    if page.parent != RESULTS:  # indented command blocks
        spans += re.findall(r"^    (\S.*)$", text, re.MULTILINE)
    missing = set()
    for span in spans:
        for path in PATH.findall(span):
            path = path.split("::")[0].rstrip("/.")
            if not path.startswith(GENERATED) and not exists(ROOT, path):
                missing.add(path)
    if page.parent.name in ("benchmarks", "results"):  # results files by name
        base = RESULTS if page.parent == RESULTS else page.parent
        for span in CODE_SPAN.findall(text):
            for name in RESULT_FILE.findall(span):
                if "/" in name or base == RESULTS:
                    ok = exists(base, name) or exists(RESULTS, name.removeprefix("results/"))
                else:
                    ok = exists(RESULTS, name)
                if not ok:
                    missing.add(name)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(missing)}"


def vapo_commands() -> list[str]:
    """Every `vapo fit|validate|sft ...` command in the user pages, one per line of shell
    (backslash continuations joined), with `{a,b}` alternatives expanded."""
    found = []
    for page in USER_PAGES:
        text = page.read_text()
        blocks = FENCE.findall(text) + re.findall(r"((?:^    .*\n)+)", text, re.MULTILINE)
        lines = [line.strip() for b in blocks for line in b.replace("\\\n", " ").splitlines()]
        lines += CODE_SPAN.findall(FENCE.sub("", text))
        for line in lines:
            for cmd in re.findall(r"(?:^|&& |\.venv/bin/)(vapo (?:fit|validate|sft)\b[^&#]*)", line):
                found += expand(cmd.strip())
    return sorted(set(found))


PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b|<|\.\.\.|my_rewards|my_reward\.py")
COMMANDS = [c for c in vapo_commands() if " -c " in c and not PLACEHOLDER.search(c)]


# A command that is only a config (on its base, for a layer) is parsed by test_config_parses.
CHAINS = {tuple(config_chain(path)) for path in CONFIGS.rglob("*.yaml")}
TO_PARSE = [
    c for c in COMMANDS if tuple(str(ROOT / a) if a.endswith(".yaml") else a for a in shlex.split(c)[1:]) not in CHAINS
]


def test_the_docs_show_vapo_commands():
    assert any("configs/quickstart.yaml" in c for c in COMMANDS), COMMANDS
    assert 0 < len(TO_PARSE) < len(COMMANDS)  # some are only a config, others add options


@pytest.mark.parametrize("command", TO_PARSE)
def test_every_vapo_command_parses(command, monkeypatch):
    """Each command in the docs that adds options to a config parses as typed."""
    monkeypatch.setattr(sys, "argv", ["vapo"])  # the command line is `args`, not pytest's
    args = shlex.split(command)[1:]
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as exit_,
    ):
        main([*args, "--print_config"])
    assert exit_.value.code in (0, None), err.getvalue()[-2000:]


def test_the_readme_starts_with_the_quickstart_and_the_ci_test_command():
    """A fresh machine's two commands: the first runs the quickstart, the second is exactly
    what `.ci/run` runs after making its venv."""
    first, second = FENCE.findall((ROOT / "README.md").read_text())[0].splitlines()[:2]
    assert first.startswith("python3 -m venv .venv && ")
    assert first.endswith("vapo fit -c configs/quickstart.yaml")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line[:1] not in "#"]
    assert "python3 -m venv .venv" in ci
    assert second == f"python3 -m venv .venv && {ci[-1]}"


HISTORY = re.compile(r"(?i)\b(session|issue|work period) #?\d+|\bissue #\d+|\bPLATFORM_NOTES\b|VAPO_SPEC")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_work_history(page):
    """The docs speak to users; what was tried, and when, is in git log."""
    hits = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not hits, f"{page.relative_to(ROOT)}: {hits}"


def test_slug_matches_githubs_anchors():
    assert slug("Asking for a minimum: `min_isolation`") == "asking-for-a-minimum-min_isolation"
    assert slug("Learning: the paper's *Table 1* in miniature") == "learning-the-papers-table-1-in-miniature"
    assert slug("[Tools](tools.md) and _emphasis_") == "tools-and-emphasis"


# --- Every quoted figure names its file -----------------------------------------------------
#
# A figure is a number with a unit (%, ms, s, min, minutes, hours, GiB, GB, MiB, MB, tokens/s,
# a ratio written with × or x) or a p-value (`p = 0.015`). The convention: each paragraph, list
# item or table row that quotes one names the file it comes from, by a link or a repository
# path in backticks: a results file in `benchmarks/results/`, or for a setting the config or
# source file that sets it. A table or a list may name it once, in the paragraph that
# introduces it, and a section once, in a paragraph that starts with "Source:" or "Full
# output:". The figure's number must be in one of those files, as written or rounded from a
# more precise number there; a whole number with its unit, or in a table row. Code spans,
# fenced and indented blocks (commands, configs, worked calculations) are not quotes.

QUOTED_PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "RESULTS.md",
]
NUMBER = r"\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?"
UNIT = r"%|ms|s|min|minutes|hours|GiB|GB|MiB|MB|tokens/s|×(?!\s?\d)|x(?![\w\d])"
FIGURE = re.compile(
    rf"(?<![\w.,/^-])(?:(?P<low>{NUMBER})\s?[-–±]\s?)?(?P<num>{NUMBER})\s?(?P<unit>{UNIT})"
    rf"(?![\w/]|\s?[×x]\s?\d)"
)
P_VALUE = re.compile(r"\bp\s?[=≈<]\s?(?P<num>0?\.\d+|1\.0+|0|1)\b")


def blocks(text: str) -> list[tuple[str, str]]:
    """(block, context): paragraphs, list items and table rows. A list item's or a table row's
    context is the paragraph that introduces its list or table (and a row's, the table's
    header); every block's context also holds its section's source line, a paragraph that
    starts with "Source" or "Full output" and covers the section down to the next heading."""
    text = FENCE.sub("", text)
    text = re.sub(r"^ {4,}\S.*$", "", text, flags=re.MULTILINE)  # indented command blocks
    out, intro, source = [], "", ""
    for para in re.split(r"\n\s*\n", text.strip()):
        if para.startswith("#"):
            source = intro = ""
        elif re.match(r"(Source|Full output)", para):
            source = para
        lines = para.splitlines()
        if lines[0].startswith("|"):  # a table: each row, with the header as context
            out += [(row, f"{intro}\n{source}\n{lines[0]}") for row in lines[2:]]
            continue
        items = re.split(r"\n(?=[-*] |\d+\. )", para)
        if re.match(r"[-*] |\d+\. ", items[0]):  # a list (or its continuation)
            out += [(item, f"{intro}\n{source}") for item in items]
            continue
        out.append((items[0], source))
        out += [(item, f"{items[0]}\n{source}") for item in items[1:]]  # a list after a line
        intro = para
    return out


def named_files(page: Path, text: str) -> list[Path]:
    """The results files (and config or source files) that `text` names, by a link or a path
    in backticks. Another page is not a source: a figure names the file that holds it."""
    found = []
    for target in LINK.findall(text):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", path):
            found.append((page.parent / path).resolve())
    for span in CODE_SPAN.findall(text):
        for path in PATH.findall(span):
            found.append(ROOT / path)
        for name in RESULT_FILE.findall(span):
            found.append(RESULTS / name.removeprefix("results/"))
    return [f for f in found if f.is_file() and (RESULTS in f.parents or f.suffix in SETTINGS)]


SETTINGS = (".yaml", ".py")  # a setting is quoted from the config or the code that sets it


SAME_UNIT = {"min": "(?:min|minutes)", "minutes": "(?:min|minutes)", "×": "[×x]", "x": "[×x]"}


def contains(source: str, number: str, unit: str | None = None) -> bool:
    """`number` written in `source` as a whole number (`3.37` not in `13.37` or `3.375`; `300`
    in `300.0`), or, when it has decimals, rounded from a more precise number there (`0.36`
    from `0.357`). A whole number with a `unit` (small ones match by chance) must stand with
    that unit in `source` or in one of its table rows."""
    plain = number.replace(",", "")
    decimals = len(plain.partition(".")[2])
    forms = {number, plain, f"{float(plain):,.{decimals}f}"}
    trailing = "0*" if decimals else r"(?:\.0+)?"  # 300 = 300.0, 3.1 = 3.10
    tokens = [rf"(?<![\d.]){re.escape(f)}{trailing}(?!\.?\d)" for f in forms]
    if unit and not decimals:
        after = SAME_UNIT.get(unit, re.escape(unit))
        return any(
            re.search(rf"{t}\s?{after}", source) or re.search(rf"^\|.*{t}", source, re.MULTILINE) for t in tokens
        )
    if any(re.search(t, source) for t in tokens):
        return True
    if not decimals:
        return False
    for found in re.findall(rf"(?<![\d.]){re.escape(plain.partition('.')[0])}\.\d{{{decimals + 1},}}", source):
        if Decimal(found).quantize(Decimal(1).scaleb(-decimals), ROUND_HALF_UP) == Decimal(plain):
            return True
    return False


def figures(text: str) -> list[tuple[str, str | None]]:
    """(number, unit) of each figure in `text`; a p-value's unit is None."""
    text = CODE_SPAN.sub("", LINK.sub(lambda m: m.group(0).split("](")[0], text))
    found = []
    for m in FIGURE.finditer(text):
        found += [(n, m.group("unit")) for n in (m.group("low"), m.group("num")) if n]
    found += [(m.group("num"), None) for m in P_VALUE.finditer(text)]
    return found


def unbacked_figures(page: Path, text: str) -> list[str]:
    """Each figure of `text` that no file its block names holds, with the start of its block."""
    problems = []
    for block, context in blocks(text):
        found = figures(block)
        if not found:
            continue
        files = list(dict.fromkeys(named_files(page, block) + named_files(page, context)))
        sources = "\n".join(f.read_text(errors="replace") for f in files)
        where = " ".join(block.split())[:70]
        if not files:
            problems.append(f"{[n for n, _ in found]} in {where!r}: names no file")
            continue
        settings = any(f.suffix in SETTINGS for f in files)  # a config writes no units
        problems += [f"{n} in {where!r}" for n, unit in found if not contains(sources, n, None if settings else unit)]
    return problems


@pytest.mark.parametrize("page", QUOTED_PAGES, ids=[str(p.relative_to(ROOT)) for p in QUOTED_PAGES])
def test_every_quoted_figure_is_in_the_file_it_names(page):
    problems = unbacked_figures(page, page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_a_figure_the_file_does_not_hold_fails(tmp_path, monkeypatch):
    """The check above can fail: a figure off by one digit, one with no file, one in a table
    whose introducing sentence names the file, and a mean before its interval."""
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", tmp_path)
    (tmp_path / "r.md").write_text("| overhead | 3.37 ms | 3.12× | p = 0.015 | 1,375 checks/s |\n")
    page = tmp_path / "page.md"
    good = "The sandbox adds 3.37 ms a run, 3.12× faster, p = 0.015 ([r](r.md)).\n"
    assert unbacked_figures(page, good) == []
    assert unbacked_figures(page, good.replace("3.37", "3.38")) == [
        "3.38 in 'The sandbox adds 3.38 ms a run, 3.12× faster, p = 0.015 ([r](r.md)).'"
    ]
    assert unbacked_figures(page, "p = 0.016 ([r](r.md))") != []
    assert "names no file" in unbacked_figures(page, "It takes 3.37 ms.")[0]
    table = "From [r](r.md):\n\n| a | b |\n|---|---|\n| x | 3.37 ms |\n| y | 1375 x |\n"
    assert unbacked_figures(page, table) == []
    assert unbacked_figures(page, table.replace("1375", "1376")) != []
    assert unbacked_figures(page, "Shapes are not figures: 16 × 4 responses, `3 ms`.") == []
    (tmp_path / "m.md").write_text("| DAPO | 37.1 ± 16.9 |\n")
    assert unbacked_figures(page, "DAPO 37.1 ± 16.9 % ([m](m.md))") == []
    assert unbacked_figures(page, "DAPO 37.2 ± 16.9 % ([m](m.md))") != []  # a mean with its interval


def test_a_rounded_figure_matches_only_its_rounding():
    assert contains("p = 0.357", "0.36") and contains("1375 checks", "1,375")
    assert not contains("p = 0.357", "0.35") and not contains("3.37 ms", "3.3")
    assert contains("3.37 ms", "3.37") and not contains("13.37 ms", "3.37")
    assert not contains("3.375", "3.37") and not contains("64.7 min", "65")
    # a whole number with a unit stands with that unit, or in a table row
    assert contains("took 20 s", "20", "s") and contains("| 7 | 20 |", "20", "s")
    assert not contains("at step 20, 3.1 s", "20", "s") and contains("5.0 min", "5", "minutes")
