rule finetune:
    input:
        module("finetune"),
        unpack(reads("finetune")),
    output:
        model=directory("results/finetune/{name}/model"),
        metrics="results/finetune/{name}/metrics.json",
        figures="results/finetune/{name}/figures.json",
        loss="results/finetune/{name}/loss.csv",
    params:
        file=PARAMS,
        settings=settings("finetune"),
    log:
        "results/logs/finetune/{name}.log",
    threads: threads_for("finetune")
    resources:
        mem_mb=mem_mb("finetune"),
        runtime=runtime("finetune"),
        **gpu_resources("finetune"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.finetune --params {params.file:q} --name {wildcards.name:q} --log {log:q}"
