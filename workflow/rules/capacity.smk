rule capacity:
    input:
        module("capacity"),
        unpack(reads("capacity")),
    output:
        cells="results/capacity/cells.csv",
        metrics="results/capacity/metrics.json",
        figures="results/capacity/figures.json",
    params:
        file=PARAMS,
        settings=settings("capacity"),
    log:
        "results/logs/capacity/capacity.log",
    threads: threads_for("capacity")
    resources:
        mem_mb=mem_mb("capacity"),
        runtime=runtime("capacity"),
        **gpu_resources("capacity"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.capacity --params {params.file:q} --log {log:q}"
