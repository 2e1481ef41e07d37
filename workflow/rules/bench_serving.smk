rule bench_serving:
    input:
        module("bench_serving"),
        unpack(reads("bench_serving")),
    output:
        requests="results/bench_serving/requests.csv",
        open_loop="results/bench_serving/open_loop_requests.csv",
        metrics="results/bench_serving/metrics.json",
        figures="results/bench_serving/figures.json",
    params:
        file=PARAMS,
        settings=settings("bench_serving"),
    log:
        "results/logs/bench_serving/bench_serving.log",
    threads: threads_for("bench_serving")
    resources:
        mem_mb=mem_mb("bench_serving"),
        runtime=runtime("bench_serving"),
        **gpu_resources("bench_serving"),
    conda:
        "../envs/efflab.yaml"
    shell:
        "python -m efflab.stages.bench_serving --params {params.file:q} --log {log:q}"
