"""README.md is the page a user reads first, docs/ holds the rest and CHANGELOG.md the history: these tests keep
the README short, keep its promises up front, keep every link between the pages landing on a file and a heading
that exist, and keep lab notes in the CHANGELOG."""

import fnmatch
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
CHANGELOG = os.path.join(REPO, "CHANGELOG.md")
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
MAX_README_LINES = 350
# A link target without a scheme: a file relative to the page, with an optional #anchor.
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")
# Words of a lab notebook, not of a user's page.
NOTEBOOK_WORDS = re.compile(r"\b(issues?|sessions?|helpers?|by hand)\b", re.I)
# How a figure was taken, which is history: CHANGELOG.md keeps it, and everywhere else a figure names its results
# file (benchmarks/results/) or a test.
LAB_NOTES = re.compile(r"\bby\s+hand\b|\bno\s+results\s+files?\b", re.I)
LAB_NOTE_FILES = ("*.py", "*.md", "*.yaml", "Makefile")
LAB_NOTES_OWN = ("CHANGELOG.md", "tests/docs_test.py")  # the history, and this rule's own patterns and examples


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    turned into hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)  # a '#' in a code block is a comment, not a heading
    return {heading_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(path: str) -> list[tuple[str, str]]:
    """(target file, anchor) of every relative link on the page; the page itself when the link is #anchor only."""
    out = []
    for target in LINK.findall(read(path)):
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        out.append((resolved, anchor))
    return out


def test_the_readme_is_at_most_350_lines():
    lines = read(README).count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ and link it"


@pytest.mark.parametrize("page", [README, CHANGELOG, *DOCS], ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_lands_on_a_file_and_heading_that_exist(page):
    broken = []
    for file, anchor in links(page):
        if not os.path.exists(file):
            broken.append(f"{os.path.relpath(file, REPO)} (no such file)")
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            broken.append(f"{os.path.relpath(file, REPO)}#{anchor} (no such heading)")
    assert not broken, f"{os.path.relpath(page, REPO)} links to: {broken}"


# A repository file named in the text (`pipeline/driver/flex_launch.py`, configs/local.yaml): modules move, and
# a page that names a file gone sends its reader nowhere.
CITED_FILE = re.compile(
    r"\b((?:pipeline|models|attention|benchmarks|tests|configs|docker|data)/[\w./-]*\w\.(?:py|yaml|json|sh|txt))\b"
)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: os.path.relpath(p, REPO))
def test_every_repository_file_a_page_names_exists(page):
    missing = sorted({path for path in CITED_FILE.findall(read(page)) if not os.path.exists(os.path.join(REPO, path))})
    assert not missing, f"{os.path.relpath(page, REPO)} names files that do not exist: {missing}"


def test_the_readme_links_every_docs_page():
    linked = {file for file, _ in links(README)}
    assert DOCS and set(DOCS) - linked == set(), "docs/ pages the README's table of contents leaves out"


def test_the_readme_says_up_front_which_models_load_and_that_nothing_ran_on_google_cloud():
    top = read(README).split("\n## ", 1)[0]
    for family in (
        "BERT",
        "RoBERTa",
        "XLM-RoBERTa",
        "ModernBERT",
        "GTE",
        "NomicBERT",
        "MPNet",
        "Qwen3",
        "sentence-transformers",
    ):
        assert family in top, f"the README's opening does not name {family}"
    assert "Nothing has run on Google Cloud yet" in top


def test_the_readme_keeps_the_two_commands():
    text = read(README)
    assert "make run " in text and "make test " in text


def test_the_readme_reads_as_a_users_page_not_a_notebook():
    found = sorted({m.group(0).lower() for m in NOTEBOOK_WORDS.finditer(read(README))})
    assert not found, f"README.md mentions {found}: say what the product does, not how it was made"


def test_the_attention_page_shows_flashs_tables_as_the_code_builds_them():
    """The kernel choice and feature tables are rendered by attention/flash/__init__.py, so a kernel that learns or
    loses a feature changes the page too; paste the new table from `feature_table()` / `auto_kernel_table()`."""
    from docbeam.attention import flash

    page = read(os.path.join(REPO, "docs", "attention.md"))
    assert flash.auto_kernel_table() in page
    assert flash.feature_table() in page


def test_the_readmes_command_list_names_every_command_the_cli_has():
    from docbeam.pipeline.driver import cli

    block = read(README).split("## The command line", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    listed = re.findall(r"^docbeam ([\w-]+)", block, re.M)
    subcommands = next(a for a in cli._parser()._actions if a.dest == "command").choices
    assert sorted(listed) == sorted(subcommands) and len(listed) == len(set(listed))


def lab_notes(root: str) -> list[str]:
    """``path:line`` of every lab note in the project's code, docs and configs under ``root``, but LAB_NOTES_OWN's;
    hidden folders (.venv, .cache, .git) and run outputs (out/) are not the project's."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in ("out", "build", "dist") and not d.endswith(".egg-info")
        )
        for name in sorted(names):
            path = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            if path in LAB_NOTES_OWN or not any(fnmatch.fnmatch(name, p) for p in LAB_NOTE_FILES):
                continue
            with open(os.path.join(root, path), errors="replace") as f:
                found += [f"{path}:{n}" for n, line in enumerate(f, 1) if LAB_NOTES.search(line)]
    return found


def test_lab_notes_stay_in_the_changelog():
    found = lab_notes(REPO)
    assert not found, (
        f"state the invariant and cite its results file or test; the history goes to CHANGELOG.md: {found}"
    )


def test_the_lab_note_rule_sees_a_note_outside_the_changelog(tmp_path):
    (tmp_path / "attention").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.py").write_text("x = 1\n# 2x faster, timed by hand\n")
    (tmp_path / "docs.md").write_text("Whole runs took 30 s (No Results File).\n")
    (tmp_path / "CHANGELOG.md").write_text("timed by hand, no results file\n")
    (tmp_path / "attention" / "a.py").write_text("# measured by hand\n")
    (tmp_path / "notes.txt").write_text("by hand\n")  # not code, docs or config
    assert sorted(lab_notes(str(tmp_path))) == ["attention/a.py:1", "docs.md:1", "models/m.py:2"]
