"""What the documentation (README.md and every docs/*.md, read through
``docs_text``) and the docstrings point a reader at exists: every
``amp_patch.x.y`` they name resolves, every contents entry finds its heading,
every relative link its file and every anchor its heading, every ``amp-patch``
subcommand is the CLI's, and every example is listed."""
from __future__ import annotations

import configparser
import importlib
import importlib.util
import re

import pytest

from amp_patch.frontends import cli
from docs_text import ROOT, anchors, doc_files, docs_text, headings, read, section, slug
from docs_text import name as file_name

pytestmark = pytest.mark.quick  # every test here is fast
DOCS = docs_text()
FILES = [file_name(p) for p in doc_files()]
#: the files with a contents line (the README's is required)
WITH_CONTENTS = [f for f in FILES if "**Contents:**" in read(f)]
#: importing it turns AMP on for the process: its names are checked without importing it
SIDE_EFFECTS = ("amp_patch.auto",)


def test_the_docs_are_the_readme_and_the_docs_folder():
    assert FILES[0] == "README.md"
    assert {"docs/guide.md", "docs/reference.md", "docs/design.md", "docs/development.md"} <= set(FILES)
    assert "README.md" in WITH_CONTENTS


@pytest.mark.parametrize("path", WITH_CONTENTS)
def test_the_contents_list_every_section_and_each_link_finds_its_heading(path):
    text = read(path)
    contents = text[text.index("**Contents:**"):text.index("\n## ")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert [a for a in links if a not in anchors(path)] == []
    top = [slug(title) for level, title, _ in headings(text) if level == 2]
    assert links == top  # every section, in order


@pytest.mark.parametrize("path", FILES)
def test_every_in_page_and_relative_link_resolves(path):
    """In-page anchors find a heading of the file; relative links resolve from
    the file's folder, and an anchor into another Markdown file finds its heading."""
    text = read(path)
    here = (ROOT / path).parent
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (here / file).resolve() if file else ROOT / path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading in {dest.relative_to(ROOT).as_posix()}")
    assert bad == []


def test_each_doc_opens_with_what_it_holds_and_links_back_to_the_readme():
    for path in FILES[1:]:
        text = read(path)
        first = text.split("\n\n")[1]  # the paragraph under the title
        assert "](../README.md" in first, path


def _names(text: str):
    return set(re.findall(r"\bamp_patch(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))


def _resolve(dotted: str) -> None:
    for module in SIDE_EFFECTS:
        if dotted == module or dotted.startswith(module + "."):
            # found without running it; its attributes exist only once it runs
            assert importlib.util.find_spec(module) is not None, module
            return
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a prefix of it is a module, not a package
            continue
        obj = importlib.import_module(module)
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return
    raise ModuleNotFoundError(dotted)


def _unresolved(names, where: str = ""):
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{where}{name}: {e}")
    return missing


def test_every_amp_patch_name_the_docs_give_resolves():
    assert _unresolved(_names(DOCS)) == []


def test_every_amp_patch_name_a_docstring_gives_resolves():
    missing = []
    for path in sorted((ROOT / "amp_patch").rglob("*.py")):
        quoted = " ".join(re.findall(r"``([^`]+)``", path.read_text(encoding="utf-8")))  # reST literals
        missing += _unresolved(_names(quoted), f"{path.relative_to(ROOT)}: ")
    assert missing == []


def test_every_amp_patch_command_the_docs_give_is_the_clis():
    subcommands = set(cli._main_parser()._subparsers._group_actions[0].choices)
    used = set(re.findall(r"\bamp-patch (--?[\w-]+|[a-z][\w-]*)", DOCS))
    assert used <= subcommands | {"--version"}, used - subcommands
    run_flags = {s for a in cli._run_parser()._actions for s in a.option_strings}
    usage = DOCS[DOCS.index("amp-patch run [--opt-level"):]
    usage = usage[:usage.index("```")]
    assert set(re.findall(r"\[(--[\w-]+)", usage)) <= run_flags


def test_the_readme_lists_every_example_and_keeps_its_two_commands():
    listed = section("Examples", "README.md")
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f"(examples/{path.name})" in listed, path.name
    two = section("Two commands", "README.md")
    assert "pip install torch==2.13.0 && pip install -e . && amp-patch demo" in two
    assert 'pip install -e ".[test]" && python -m pytest -q' in two
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q\n" in ci  # the README's test command is CI's


def _extra(name: str) -> list:
    """The requirement names of setup.cfg's extra ``name``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    lines = cfg["options.extras_require"].get(name, "").strip().splitlines()
    return [re.split(r"[<>=!~;\s\[]", line.strip(), maxsplit=1)[0] for line in lines if line.strip()]


def test_the_tools_the_docs_run_come_with_the_extra_they_name():
    """`python -m pyflakes amp_patch` works after the install the docs name for it."""
    for tool in ("pyflakes",):
        lines = [line for line in DOCS.splitlines() if f"python -m {tool}" in line]
        assert lines, tool
        said = re.findall(r"the (\w+) extra", DOCS[DOCS.index(f"python -m {tool}"):][:400])
        assert said and tool in _extra(said[0]), (tool, said)


@pytest.mark.parametrize("extra", ["plot", "examples", "test"])
def test_the_extras_the_docs_install_exist(extra):
    cfg = (ROOT / "setup.cfg").read_text()
    assert f"pip install -e '.[{extra}]'" in DOCS or f'pip install -e ".[{extra}]"' in DOCS
    assert re.search(rf"^{extra} =$", cfg, flags=re.M), extra
