rule merge:
    input:
        module("merge"),
        adapter="results/finetune/{name}/model",
        base="results/base_model/metrics.json",
        validation="results/prepare_data/validation.parquet",
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
