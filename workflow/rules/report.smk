# The report's plots and their category in `snakemake --report` (captions: workflow/report/<plot>.rst).
REPORT_PLOTS = {"quantize": "Quantization", "prune": "Pruning", "qat": "Quantization-aware training", "finetune": "Fine-tuning", "finetune_pareto": "Fine-tuning",
                "finetune_loss": "Fine-tuning", "bench_attention": "Attention",
                "bench_attention_memory": "Attention", "bench_inference": "Inference", "bench_serving": "Serving", "capacity": "Capacity",
                "inference_pareto": "Inference"}


rule report:
    input:
        module("report"),
        expand("results/quantize/{name}/metrics.json", name=names("quantize")),
        expand("results/prune/{name}/metrics.json", name=names("prune")),
        expand("results/finetune/{name}/metrics.json", name=names("finetune")),
        expand("results/merge/{name}/metrics.json", name=names("merge")),
        asked("qat", "results/qat/metrics.json"),
        asked("bench_finetune", "results/bench_finetune/metrics.json"),
        asked("bench_serving", "results/bench_serving/metrics.json"),
        asked("capacity", "results/capacity/metrics.json"),
        expand("results/bench_attention/{name}/metrics.json", name=names("bench_attention")),
        expand("results/bench_inference/{name}/metrics.json", name=names("bench_inference")),
        expand("results/evaluate/{name}/metrics.json", name=names("evaluate")),
        "results/prepare_data/metrics.json",
        repo_file("workflow/profiles/gpu/params.yaml"),  # the larger experiment: what this run leaves out of it
        claims="results/claims/claims.md",
    output:
        report="results/report/report.md",
        summary=report("results/report/summary.csv", caption="../report/summary.rst", category="Tables"),
        details="results/report/details.md",
        plots=[report(f"results/report/{plot}.png", caption=f"../report/{plot}.rst", category=category)
               for plot, category in REPORT_PLOTS.items()],
        pareto=expand("results/report/{kind}_pareto.csv", kind=["finetune", "inference"]),
        metrics="results/report/metrics.json",
        figures="results/report/figures.json",
        decisions="results/report/decisions.json",
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
