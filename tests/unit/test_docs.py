"""The docs cannot drift from the code (issue 58; docs/dev/testing.md): the configuration and
command-line references are generated from the pydantic model and the argparse parsers
(scripts/docs_reference.py), so every field and every flag needs a description, and the generated
pages list every one of them. The README stays a short user's page: no dates, commit hashes or
suite timings (those go to CHANGELOG.md and the performance page)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO

ROOT = Path(REPO)


def reference():
    """scripts/docs_reference.py, the mkdocs hook that writes the references (not a package module)."""
    if "docs_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["docs_reference"] = module  # (its dataclass looks its module up there)
        spec.loader.exec_module(module)
    return sys.modules["docs_reference"]


def test_every_config_field_has_a_description():
    missing = [f.name for f in reference().config_fields() if not f.description]
    assert not missing, f"config fields without description= (ftjax/config.py): {missing}"


def test_the_config_reference_lists_every_field_of_config():
    from ftjax.config import Config

    def names(model, prefix=""):
        out = []
        for name, info in model.model_fields.items():
            out.append(prefix + name)
            if isinstance(info.annotation, type) and hasattr(info.annotation, "model_fields"):
                out += names(info.annotation, prefix + name + ".")
        return out

    page = reference().config_markdown()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", page, re.M)) | set(re.findall(r"^### `([\w.]+)`", page, re.M))
    assert listed == set(names(Config))


def test_every_cli_flag_has_a_help_text():
    ref = reference()
    missing = [
        f"ftjax {name}: {action.dest}"
        for name, parser in ref.cli_parsers().items()
        for action in ref.cli_flags(parser)
        if not action.help
    ]
    assert not missing, "arguments without help= : " + ", ".join(missing)


def test_the_cli_reference_lists_every_subcommand_and_flag():
    from ftjax.cli.bench import BENCHES
    from ftjax.cli.main import COMMANDS

    ref = reference()
    page = ref.cli_markdown()
    for name in COMMANDS:
        assert f"[`ftjax {name}`]" in page
    for name in BENCHES:
        assert f"### `ftjax bench {name}`" in page
    for name, parser in ref.cli_parsers().items():
        section = page.split(f"### `ftjax {name}`\n", 1)[1].split("\n### ", 1)[0]
        for action in ref.cli_flags(parser):
            for option in action.option_strings or [action.metavar or action.dest]:
                assert f"`{option}" in section, f"ftjax {name}: {option} missing from the CLI reference"


def test_a_flag_without_help_fails_the_check():
    """The check above can fail: a parser with an undocumented flag is found."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--documented", help="yes")
    p.add_argument("--bare")
    assert [a.dest for a in reference().cli_flags(p) if not a.help] == ["bare"]


def test_the_readme_is_short_and_holds_no_history():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date in README.md: history goes to CHANGELOG.md"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
    assert not re.search(r"\d+ passed", text), "suite timings go to docs/dev/testing.md"


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md")) or ["none"])
def test_guides_link_only_to_pages_that_exist(page):
    if page == "none":
        pytest.skip("no guides")
    path = ROOT / "docs" / "guides" / page
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", path.read_text()):
        if not target.startswith("http"):
            assert (path.parent / target).resolve().exists(), f"{page} links to {target}, which does not exist"
