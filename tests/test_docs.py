"""The README and docs/ cannot drift from the code: the spec and knob pages are the
generator's output, and every spec key or knob a page names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autotune import knobs
from autotune.outputs.reference import (
    KNOBS_PAGE,
    SPEC_PAGE,
    knobs_markdown,
    spec_keys,
    spec_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SECTIONS = ("model", "data", "hardware", "search", "measure", "run")
# `name=value` spellings on the pages that are no knob: library arguments.
NOT_KNOBS = {"torch", "strict", "install", "gradient_as_bucket_view"}


@pytest.mark.parametrize(("page", "render"), [(SPEC_PAGE, spec_markdown),
                                              (KNOBS_PAGE, knobs_markdown)])
def test_the_reference_pages_are_what_the_code_writes(page, render):
    """Every key of the pydantic models and every knob of the table, and nothing else:
    `python -m autotune.outputs.reference docs/` rewrites them."""
    assert (ROOT / "docs" / page).read_text() == render()


def test_every_spec_key_and_knob_is_on_its_page():
    spec_page = (ROOT / "docs" / SPEC_PAGE).read_text()
    for key in spec_keys():
        assert f"`{key}`" in spec_page, key
    knob_page = (ROOT / "docs" / KNOBS_PAGE).read_text()
    for k in knobs.table():
        assert f"`{k.name}`" in knob_page, k.name


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_a_page_names_only_spec_keys_and_knobs_that_exist(path):
    text = path.read_text()
    keys = set(spec_keys())
    for key in re.findall(rf"`((?:{'|'.join(SECTIONS)})\.[a-z_.]+)`", text):
        assert key.rstrip(".") in keys, f"{path.name} names spec key {key}, which is none"
    names = set(knobs.names())
    for name in re.findall(r"`([a-z_]+)` knob", text):
        assert name in names, f"{path.name} names knob {name}, which is none"
    for name, value in re.findall(r"`([a-z_]+)=([^`\s]+)`", text):
        if name in NOT_KNOBS:
            continue
        assert name in names, f"{path.name} names knob {name}={value}: no such knob"
        allowed = {str(v) for v in knobs.knob(name).allowed()}
        assert value in allowed, f"{path.name}: {name}={value}; {name} takes {allowed}"


def test_the_readme_is_short_and_names_no_commit():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\b[0-9a-f]{7}\b(?![-.\w])", text.replace("AAAA", "")), \
        "a commit hash in the README: history goes in docs/results.md"
