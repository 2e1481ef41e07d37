rule base_model:
    input:
        module("base_model"),
        local_source("base_model"),
    output:
        model=directory("results/base_model/model"),
        metrics="results/base_model/metrics.json",
        figures="results/base_model/figures.json",
    params:
        file=PARAMS,
        settings=settings("base_model"),
    log:
        "results/logs/base_model/base_model.log",
    threads: threads_for("base_model")
    resources:
        mem_mb=mem_mb("base_model"),
        runtime=runtime("base_model"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.base_model --params {params.file:q} --log {log:q}"
