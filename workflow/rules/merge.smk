rule merge:
    input:
        module("merge"),
        unpack(reads("merge")),
    output:
        model=directory("results/merge/{name}/model"),
        metrics="results/merge/{name}/metrics.json",
        figures="results/merge/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("merge"),
    log:
        "results/logs/merge/{name}.log",
    threads: threads_for("merge")
    resources:
        mem_mb=mem_mb("merge"),
        runtime=runtime("merge"),
        **gpu_resources("merge"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.merge --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
