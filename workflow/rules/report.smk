rule report:
    input:
        module("report"),
        expand("results/quantize/{name}/metrics.json", name=names("quantize")),
        expand("results/finetune/{name}/metrics.json", name=names("finetune")),
        expand("results/merge/{name}/metrics.json", name=names("merge")),
        expand("results/bench_attention/{name}/metrics.json", name=names("bench_attention")),
        expand("results/bench_inference/{name}/metrics.json", name=names("bench_inference")),
        "results/prepare_data/metrics.json",
        claims="results/claims/claims.md",
    output:
        report="results/report/report.md",
        summary="results/report/summary.csv",
        plots=expand("results/report/{plot}.png",
                     plot=["quantize", "finetune_loss", "bench_attention", "bench_attention_memory",
                           "bench_inference"]),
        metrics="results/report/metrics.json",
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
        "python -m efflab.report --params {params.file:q} --log {log:q}"
