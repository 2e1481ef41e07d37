rule bench_attention:
    input:
        module("bench_attention"),
        base="results/base_model/metrics.json",
    output:
        metrics="results/bench_attention/{name}/metrics.json",
    params:
        file=PARAMS,
        settings=settings("bench_attention"),
    log:
        "results/logs/bench_attention/{name}.log",
    threads: HEAVY
    resources:
        mem_mb=6000,
    shell:
        "python -m efflab.bench_attention --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
