rule qat:
    input:
        module("qat"),
        unpack(reads("qat")),
    output:
        finetuned=directory("results/qat/finetuned"),
        evals="results/qat/evals.csv",
        losses="results/qat/losses.csv",
        metrics="results/qat/metrics.json",
        figures="results/qat/figures.json",
    params:
        file=PARAMS,
        settings=settings("qat"),
    log:
        "results/logs/qat/qat.log",
    threads: threads_for("qat")
    resources:
        mem_mb=mem_mb("qat"),
        runtime=runtime("qat"),
        **gpu_resources("qat"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.qat --params {params.file:q} --log {log:q}"
