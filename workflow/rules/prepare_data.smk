rule prepare_data:
    input:
        module("prepare_data"),
        local_source("prepare_data"),
        unpack(reads("prepare_data")),
    output:
        train="results/prepare_data/train.parquet",
        validation="results/prepare_data/validation.parquet",
        task=directory("results/prepare_data/lm_eval"),
        metrics="results/prepare_data/metrics.json",
        figures="results/prepare_data/figures.json",
    params:
        file=PARAMS,
        settings=settings("prepare_data"),
    log:
        "results/logs/prepare_data/prepare_data.log",
    threads: 1
    resources:
        mem_mb=mem_mb("prepare_data"),
        runtime=runtime("prepare_data"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.prepare_data --params {params.file:q} --log {log:q}"
