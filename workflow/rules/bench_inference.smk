rule bench_inference:
    input:
        module("bench_inference"),
        unpack(reads("bench_inference")),
    output:
        metrics="results/bench_inference/{name}/metrics.json",
        figures="results/bench_inference/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("bench_inference"),
    log:
        "results/logs/bench_inference/{name}.log",
    threads: threads_for("bench_inference")
    resources:
        mem_mb=mem_mb("bench_inference"),
        runtime=runtime("bench_inference"),
        **gpu_resources("bench_inference"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.bench_inference --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
