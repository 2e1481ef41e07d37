rule quantize:
    input:
        module("quantize"),
        unpack(reads("quantize")),
    output:
        model=directory("results/quantize/{name}/model"),
        metrics="results/quantize/{name}/metrics.json",
        figures="results/quantize/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("quantize"),
    log:
        "results/logs/quantize/{name}.log",
    threads: threads_for("quantize")
    resources:
        mem_mb=mem_mb("quantize"),
        runtime=runtime("quantize"),
        **gpu_resources("quantize"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.quantize --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
