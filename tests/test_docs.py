"""The documentation: the configuration reference is generated from the fields (never stale), the README is the
short front door whose links resolve, and every page is in the site's navigation (`make docs` builds it --strict)."""

import os
import re

import yaml

from trl_fp8.config import TRL_FP8_FIELDS, field_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def test_the_configuration_reference_is_generated_from_the_fields():
    with open(os.path.join(DOCS, "configuration.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == field_reference(), "regenerate: python -m trl_fp8.config > docs/configuration.md"
    for name in TRL_FP8_FIELDS:
        assert f"| `{name}` |" in committed, name


def test_the_readme_is_a_short_front_door_whose_links_resolve():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text  # the two set-up commands
    links = re.findall(r"\]\(([^)#]+)\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links to the documentation pages"
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


def _nav_pages(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)


def test_every_page_is_in_the_navigation_and_every_entry_exists():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    nav = set(_nav_pages(config["nav"]))
    pages = {name for name in os.listdir(DOCS) if name.endswith(".md")}
    assert nav == pages, (sorted(pages - nav), sorted(nav - pages))
    assert config.get("strict") is True
