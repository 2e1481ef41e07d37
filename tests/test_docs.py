"""The documentation: the generated params reference is in step with the schema and params.yaml, the MkDocs site
builds with no warning, the README stays a short entry point, and every stage has its page."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from efflab import config, registry
from efflab.tools import docs_reference
from tests.helpers import REPO

STAGE_RULES = sorted(registry.STAGES)


def test_the_params_reference_is_in_step_with_the_schema_and_params_yaml():
    assert docs_reference.PAGE.read_text() == docs_reference.render(), \
        "docs/reference/params.md is out of date: run `python -m efflab.tools.docs_reference`"


def test_the_stages_nav_is_in_step_with_the_stage_registry():
    assert docs_reference.MKDOCS.read_text() == docs_reference.render_nav(docs_reference.MKDOCS.read_text()), \
        "mkdocs.yml's Stages nav is out of date: run `python -m efflab.tools.docs_reference`"


def test_the_figures_page_is_in_step_with_the_stage_registry():
    assert docs_reference.FIGURES_PAGE.read_text() == docs_reference.render_figures(), \
        "docs/reference/figures.md is out of date: run `python -m efflab.tools.docs_reference`"


def test_the_params_reference_has_every_key_of_the_schema():
    page = docs_reference.PAGE.read_text()
    missing = [key for key in config.descriptions() if f"| `{key}` |" not in page and "." in key]
    assert not missing, f"keys without a row: {missing}"


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.is_file(), f"mkdocs is not installed next to {sys.executable}: `make install` (the dev extra)"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "params" / "index.html").is_file()


def test_the_readme_is_a_short_entry_point_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is for users: at most 150 lines; the rest belongs in docs/"
    assert "make run     #" in readme and "make test    #" in readme


def test_every_stage_has_its_page():
    assert STAGE_RULES, "no rule files found"
    missing = [s for s in STAGE_RULES if not (REPO / "docs" / "stages" / f"{s}.md").is_file()]
    assert not missing, f"stages without docs/stages/<stage>.md: {missing}"
    nav = (REPO / "mkdocs.yml").read_text()
    assert all(f"stages/{s}.md" in nav for s in STAGE_RULES), "a stage page is missing from mkdocs.yml's nav"
