rule bench_attention:
    input:
        module("bench_attention"),
        unpack(reads("bench_attention")),
    output:
        metrics="results/bench_attention/{name}/metrics.json",
        figures="results/bench_attention/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("bench_attention"),
    log:
        "results/logs/bench_attention/{name}.log",
    threads: threads_for("bench_attention")
    resources:
        mem_mb=mem_mb("bench_attention"),
        runtime=runtime("bench_attention"),
        **gpu_resources("bench_attention"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.bench_attention --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
