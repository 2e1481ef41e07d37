rule claims:
    input:
        module("claims"),
        module("estimate"),
        "workflow/claims.yaml",
        "workflow/schemas/claims.schema.yaml",
        expand("workflow/models/{model}.json", model=glob_wildcards("workflow/models/{model}.json").model),
        "results/base_model/metrics.json",
        expand("results/quantize/{name}/metrics.json", name=names("quantize")),
        expand("results/finetune/{name}/metrics.json", name=names("finetune")),
        expand("results/bench_attention/{name}/metrics.json", name=names("bench_attention")),
    output:
        csv="results/claims/claims.csv",
        md="results/claims/claims.md",
        metrics="results/claims/metrics.json",
    params:
        file=PARAMS,
        settings=settings("claims"),
    log:
        "results/logs/claims/claims.log",
    threads: 1
    shell:
        "python -m efflab.claims --params {params.file:q} --log {log:q}"
