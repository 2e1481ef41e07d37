# efflab: the experiment DAG. Wiring only; every stage's work is `python -m efflab.stages.<stage>`.
# Run: snakemake --cores all            (params.yaml)
#      snakemake --cores 2 --configfile tests/config/params.test.yaml
#      snakemake --cores 1 --report results/report/report.html   (after a run: plots and tables by stage)
from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
# One rule a stage, made from the stage registry (common.smk imports it); the report's is its own file.
include: "workflow/rules/stages.smk"
include: "workflow/rules/report.smk"


onstart:
    warn_mixed_drivers()
    start_job_server()


onsuccess:
    fail_if_jobs_failed()


rule all:
    input:
        rules.report.output,
    default_target: True
