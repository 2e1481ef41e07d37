# The report's rule, written by hand (registry.Stage.own_rule): its outputs carry the captions of Snakemake's HTML
# report.
from efflab.stages.report.parts import report_plots


rule report:
    input:
        code("report"),
        unpack(reads("report")),  # every earlier job's record
        claims="results/claims/claims.md",
    output:
        report="results/report/report.md",
        summary=report("results/report/summary.csv", caption="../report/summary.rst", category="Tables"),
        details="results/report/details.md",
        plots=[report(f"results/report/{plot}.png", caption=f"../report/{plot}.rst", category=category)
               for plot, category in report_plots()],  # each part's plots (report.parts), captioned by workflow/report/
        pareto=expand("results/report/{kind}_pareto.csv", kind=["finetune", "inference"]),
        metrics="results/report/metrics.json",
        figures="results/report/figures.json",
        decisions="results/report/decisions.json",
        statements="results/report/statements.jsonl",  # the ledger of what each place states (report.ledger)
    params:
        file=PARAMS,
        settings=settings("report"),
    log:
        "results/logs/report/report.log",
    threads: 1
    resources:
        mem_mb=mem_mb("report"),
        runtime=runtime("report"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.report --params {params.file:q} --log {log:q}"
