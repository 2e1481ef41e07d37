rule evaluate:
    input:
        unpack(evaluate_inputs),
        module("evaluate"),
        base="results/base_model/metrics.json",
        task="results/prepare_data/lm_eval",
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
