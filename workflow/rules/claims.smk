rule claims:
    input:
        module("claims"),
        repo_file("src/efflab/estimators/analytic.py"),
        repo_file("workflow/claims.yaml"),
        repo_file("workflow/schemas/claims.schema.yaml"),
        model_configs(),
        "results/base_model/metrics.json",
        expand("results/quantize/{name}/metrics.json", name=names("quantize")),
        expand("results/prune/{name}/metrics.json", name=names("prune")),
        expand("results/finetune/{name}/metrics.json", name=names("finetune")),
        asked("bench_finetune", "results/bench_finetune/metrics.json"),
        asked("bench_serving", "results/bench_serving/metrics.json"),
        expand("results/bench_attention/{name}/metrics.json", name=names("bench_attention")),
        expand("results/bench_inference/{name}/metrics.json", name=names("bench_inference")),
        expand("results/evaluate/{name}/metrics.json", name=names("evaluate")),
    output:
        csv="results/claims/claims.csv",
        md="results/claims/claims.md",
        summary="results/claims/summary.json",
        metrics="results/claims/metrics.json",
        figures="results/claims/figures.json",
    params:
        file=PARAMS,
        settings=settings("claims"),
    log:
        "results/logs/claims/claims.log",
    threads: 1
    resources:
        mem_mb=mem_mb("claims"),
        runtime=runtime("claims"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.claims --params {params.file:q} --log {log:q}"
