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
from pathlib import Path

import pytest

from vapo_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted(
    [
        ROOT / "README.md",
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
    "callbacks",
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
            for cmd in re.findall(
                r"(?:^|&& |\.venv/bin/)(vapo (?:fit|validate|sft)\b[^&#]*)", line
            ):
                found += expand(cmd.strip())
    return sorted(set(found))


PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b|<|\.\.\.|my_rewards|my_reward\.py")
COMMANDS = [c for c in vapo_commands() if " -c " in c and not PLACEHOLDER.search(c)]


def test_the_docs_show_vapo_commands():
    assert any("configs/quickstart.yaml" in c for c in COMMANDS), COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_every_vapo_command_parses(command, monkeypatch):
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


HISTORY = re.compile(
    r"(?i)\b(session|issue|work period) #?\d+|\bissue #\d+|\bPLATFORM_NOTES\b|VAPO_SPEC"
)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_work_history(page):
    """The docs speak to users; what was tried, and when, is in git log."""
    hits = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not hits, f"{page.relative_to(ROOT)}: {hits}"


def test_slug_matches_githubs_anchors():
    assert slug("Asking for a minimum: `min_isolation`") == "asking-for-a-minimum-min_isolation"
    assert (
        slug("Learning: the paper's *Table 1* in miniature")
        == "learning-the-papers-table-1-in-miniature"
    )
    assert slug("[Tools](tools.md) and _emphasis_") == "tools-and-emphasis"
