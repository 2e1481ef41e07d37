rule evaluate:
    input:
        module("evaluate"),
        unpack(reads("evaluate")),
    output:
        task=directory("results/evaluate/{name}/lm_eval"),
        metrics="results/evaluate/{name}/metrics.json",
        figures="results/evaluate/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("evaluate"),
    log:
        "results/logs/evaluate/{name}.log",
    threads: threads_for("evaluate")
    resources:
        mem_mb=mem_mb("evaluate"),
        runtime=runtime("evaluate"),
        **gpu_resources("evaluate"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.evaluate --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
