rule base_model:
    input:
        module("base_model"),
    output:
        model=directory("results/base_model/model"),
        metrics="results/base_model/metrics.json",
    log:
        "results/logs/base_model/base_model.log",
    threads: HEAVY
    resources:
        mem_mb=4000,
    shell:
        "python -m efflab.base_model --params {PARAMS:q} --log {log:q}"
