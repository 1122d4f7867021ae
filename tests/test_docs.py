"""What the README and the docstrings point a reader at exists: every
``amp_patch.x.y`` they name resolves, every contents entry finds its heading,
every relative link its file, every ``amp-patch`` subcommand is the CLI's, and
every example is listed."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from amp_patch.frontends import cli

pytestmark = pytest.mark.quick  # every test here is fast
ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: importing it turns AMP on for the process: its names are checked without importing it
SIDE_EFFECTS = ("amp_patch.auto",)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def test_the_contents_list_every_section_and_each_link_finds_its_heading():
    headings = re.findall(r"^#{2,3} (.+)$", README, flags=re.M)
    slugs = {_slug(h) for h in headings}
    contents = README[README.index("**Contents:**"):README.index("\n## ")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert [a for a in links if a not in slugs] == []
    top = [_slug(h) for h in re.findall(r"^## (.+)$", README, flags=re.M)]
    assert links == top  # every section, in order


def test_every_in_page_and_relative_link_resolves():
    slugs = {_slug(h) for h in re.findall(r"^#{2,6} (.+)$", README, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("#"):
            assert target[1:] in slugs, target
        elif "://" not in target:
            assert (ROOT / target.split("#")[0]).exists(), target


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


def test_every_amp_patch_name_the_readme_gives_resolves():
    assert _unresolved(_names(README)) == []


def test_every_amp_patch_name_a_docstring_gives_resolves():
    missing = []
    for path in sorted((ROOT / "amp_patch").rglob("*.py")):
        quoted = " ".join(re.findall(r"``([^`]+)``", path.read_text(encoding="utf-8")))  # reST literals
        missing += _unresolved(_names(quoted), f"{path.relative_to(ROOT)}: ")
    assert missing == []


def test_every_amp_patch_command_the_readme_gives_is_the_clis():
    subcommands = set(cli._main_parser()._subparsers._group_actions[0].choices)
    used = set(re.findall(r"\bamp-patch (--?[\w-]+|[a-z][\w-]*)", README))
    assert used <= subcommands | {"--version"}, used - subcommands
    run_flags = {s for a in cli._run_parser()._actions for s in a.option_strings}
    usage = README[README.index("amp-patch run [--opt-level"):]
    usage = usage[:usage.index("```")]
    assert set(re.findall(r"\[(--[\w-]+)", usage)) <= run_flags


def test_the_readme_lists_every_example_and_keeps_its_two_commands():
    listed = _section("Examples")
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f"(examples/{path.name})" in listed, path.name
    two = _section("Two commands")
    assert "pip install torch==2.13.0 && pip install -e . && amp-patch demo" in two
    assert 'pip install -e ".[test]" && python -m pytest -q' in two
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q\n" in ci  # the README's test command is CI's


@pytest.mark.parametrize("extra", ["plot", "examples", "test"])
def test_the_extras_the_readme_installs_exist(extra):
    cfg = (ROOT / "setup.cfg").read_text()
    assert f"pip install -e '.[{extra}]'" in README or f'pip install -e ".[{extra}]"' in README
    assert re.search(rf"^{extra} =$", cfg, flags=re.M), extra
