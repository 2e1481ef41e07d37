# efflab: the experiment DAG. Wiring only; every stage's work is `python -m efflab.stages.<stage>`.
# Run: snakemake --cores all            (params.yaml)
#      snakemake --cores 2 --configfile tests/config/params.test.yaml
#      snakemake --cores 1 --report results/report/report.html   (after a run: plots and tables by stage)
from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/base_model.smk"
include: "workflow/rules/prepare_data.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/prune.smk"
include: "workflow/rules/qat.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/bench_finetune.smk"
include: "workflow/rules/bench_attention.smk"
include: "workflow/rules/bench_inference.smk"
include: "workflow/rules/bench_serving.smk"
include: "workflow/rules/capacity.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/claims.smk"
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
