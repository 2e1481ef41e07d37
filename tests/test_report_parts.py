"""The report laid out by stage (report.parts): every stage has a part or says where the report shows it, and each
part's section, tables, plots and captions exist and agree with the report rule (workflow/rules/report.smk)."""
import inspect
import subprocess
import sys

import pytest

from efflab import config, registry
from efflab.registry import STAGES
from efflab.stages.report import draw, sections
from efflab.stages.report.parts import ELSEWHERE, PARTS, report_plots, resolve
from tests.helpers import REPO

CAPTIONS = REPO / "workflow" / "report"
TEMPLATES = REPO / "src" / "efflab" / "stages" / "report" / "templates" / "sections"
# Captions that are no part's plot: the Snakefile's `report:` page, and the long results table (summary.csv).
OTHER_CAPTIONS = {"workflow", "summary"}
# Section templates that are no part's: what report.md says around the parts, and details.md's memory section.
OTHER_SECTIONS = {"header", "how_to_read", "footer", "memory", "not_run", "profile", "run_size", "samples",
                  "capacity_misses", "part"}
TABLES = [(part, table) for part in PARTS.values() for table in part.tables]
PLOTS = [plot for plot, _ in report_plots()]


def test_every_stage_has_a_report_part_or_says_where_the_report_shows_it():
    """A new stage of the registry writes records the report reads (report.results.read_results): its row's `report`
    is its part, or a line saying where the report shows it."""
    missing = [s for s in STAGES if s not in PARTS and s not in ELSEWHERE]
    assert not missing, f"no report part and no line saying where the report shows it (registry.Stage.report): {missing}"
    assert not set(PARTS) & set(ELSEWHERE), "a stage has a part and is also shown elsewhere"
    assert set(ELSEWHERE) <= set(STAGES), "ELSEWHERE names a stage the registry does not have"
    assert all(ELSEWHERE.values())


@pytest.mark.parametrize("part", PARTS.values(), ids=list(PARTS))
def test_each_part_s_section_has_its_body_and_template(part):
    if not part.section:  # its tables alone
        assert part.tables and part.title.startswith("## ") and part.category
        return
    body = getattr(sections, f"{part.section}_body", None)
    assert callable(body), f"report.sections has no {part.section}_body"
    assert (TEMPLATES / f"{part.section}.md.j2").is_file()
    assert f'"sections/{part.section}.md.j2"' in inspect.getsource(body), "the body renders another template"
    assert part.title.startswith("## ") and part.category


def test_every_section_template_is_a_part_s_or_one_of_the_report_s_own():
    found = {p.name.removesuffix(".md.j2") for p in TEMPLATES.glob("*.md.j2")}
    assert found == {p.section for p in PARTS.values() if p.section} | OTHER_SECTIONS


@pytest.mark.parametrize(("part", "table"), TABLES, ids=[t.name for _, t in TABLES])
def test_each_table_s_builder_exists_and_reads_stages_of_the_registry(part, table):
    assert bool(table.build) != bool(table.columns), "a table has a builder or its columns, not both"
    assert not table.build or callable(resolve(table.build)), table.build
    assert set(table.reads) <= set(STAGES) and (table.keys is None or table.keys >= 1)


def test_table_and_plot_names_are_unique():
    names = [t.name for _, t in TABLES]
    assert len(names) == len(set(names)) and len(PLOTS) == len(set(PLOTS))


@pytest.mark.parametrize("plot", PLOTS)
def test_each_plot_has_its_drawer_and_its_caption(plot):
    assert callable(getattr(draw, plot, None)), f"report.draw has no {plot}(given, path)"
    caption = CAPTIONS / f"{plot}.rst"
    assert caption.is_file() and caption.read_text().strip(), f"{caption} is missing or empty"


def test_every_caption_belongs_to_a_plot_of_a_part():
    assert {p.stem for p in CAPTIONS.glob("*.rst")} == set(PLOTS) | OTHER_CAPTIONS


def test_the_part_table_loads_without_pandas_matplotlib_or_torch():
    """Snakemake reads it (report.smk) while it plans the DAG."""
    code = ("import sys; import efflab.stages.report.parts; "
            "print(sorted({'pandas', 'matplotlib', 'torch'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_report_rule_draws_each_part_s_plots_and_the_claims_rule_and_it_wait_for_every_earlier_job():
    """The default experiment's dry run: the report's plots are the parts', and the claims' and the report's inputs
    the records of every earlier job the experiment runs (registry.earlier_records)."""
    from efflab.tools import dvcgen

    jobs = {j["rule"]: j for j in dvcgen.snakemake_jobs("params.yaml", REPO) if j["rule"] in ("claims", "report")}
    assert [o for o in jobs["report"]["output"] if o.endswith(".png")] == [f"results/report/{plot}.png" for plot in PLOTS]
    cfg = config.load(REPO / "params.yaml")
    for stage, job in jobs.items():
        earlier = list(STAGES)[:list(STAGES).index(stage)]
        wanted = {f"results/{s}/{name}/metrics.json" if name else f"results/{s}/metrics.json" for s in earlier
                  if not registry.not_asked(cfg, s) for name in registry.names(cfg, s) or [None]}
        assert {i for i in job["input"] if i.endswith("/metrics.json")} == wanted, stage
        assert "results/qat/metrics.json" in wanted  # the claims read qat's record (claims.readings)


def test_a_table_declared_by_its_columns_has_a_row_a_job_that_produced_numbers():
    from efflab.stages.report.tables import columns_table

    jobs = [{"status": "ok", "name": "a", "speed": {"median": 1.5}}, {"status": "failed", "name": "b"},
            {"status": "ok", "name": "c"}]
    frame = columns_table(jobs, (("job", "name"), ("speed", "speed.median")))
    assert list(frame.columns) == ["job", "speed", "env"] and frame["job"].tolist() == ["a", "c"]
    assert frame["speed"].iloc[0] == 1.5 and frame["speed"].isna().tolist() == [False, True]
