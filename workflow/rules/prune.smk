rule prune:
    input:
        module("prune"),
        unpack(reads("prune")),
    output:
        model=directory("results/prune/{name}/model"),
        healed=directory("results/prune/{name}/healed"),
        metrics="results/prune/{name}/metrics.json",
        figures="results/prune/{name}/figures.json",
    params:
        file=PARAMS,
        settings=settings("prune"),
    log:
        "results/logs/prune/{name}.log",
    threads: threads_for("prune")
    resources:
        mem_mb=mem_mb("prune"),
        runtime=runtime("prune"),
        **gpu_resources("prune"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.prune --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
