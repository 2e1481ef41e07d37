rule bench_finetune:
    input:
        module("bench_finetune"),
        module("finetune"),
        unpack(reads("bench_finetune")),
    output:
        metrics="results/bench_finetune/metrics.json",
        figures="results/bench_finetune/figures.json",
    params:
        file=PARAMS,
        settings=settings("bench_finetune"),
    log:
        "results/logs/bench_finetune/bench_finetune.log",
    threads: threads_for("bench_finetune")
    resources:
        mem_mb=mem_mb("bench_finetune"),
        runtime=runtime("bench_finetune"),
        **gpu_resources("bench_finetune"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.bench_finetune --params {params.file:q} --log {log:q}"
