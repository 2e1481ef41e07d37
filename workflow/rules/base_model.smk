rule base_model:
    input:
        module("base_model"),
    output:
        model=directory("results/base_model/model"),
        metrics="results/base_model/metrics.json",
    params:
        file=PARAMS,
        settings=settings("base_model"),
    log:
        "results/logs/base_model/base_model.log",
    threads: HEAVY
    resources:
        mem_mb=4000,
    shell:
        "python -m efflab.base_model --params {params.file:q} --log {log:q}"
