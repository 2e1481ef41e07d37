rule finetune:
    input:
        module("finetune"),
        base="results/base_model/metrics.json",
        train="results/prepare_data/train.parquet",
        validation="results/prepare_data/validation.parquet",
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
