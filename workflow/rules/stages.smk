# One rule a stage, made from its row of the stage registry (efflab.registry.STAGES), in DAG order: its inputs are
# its code and what it reads of earlier jobs, its outputs what the row says it writes, its command its CLI. A stage
# whose rule is written by hand (Stage.own_rule) has its own file, workflow/rules/<stage>.smk.
for _stage in [s.name for s in registry.STAGES.values() if not s.own_rule]:

    rule:
        name:
            _stage
        input:
            code(_stage),
            local_source(_stage),
            unpack(reads(_stage)),
        output:
            **outputs(_stage),
        params:
            module=registry.module(_stage),
            job=job_args(_stage),
            file=PARAMS,
            settings=settings(_stage),
        log:
            log_file(_stage),
        threads: threads_for(_stage)
        resources:
            mem_mb=mem_mb(_stage),
            runtime=runtime(_stage),
            **gpu_resources(_stage),
        conda:
            "../envs/efflab.yaml"
        shell:
            # a literal: Snakemake evaluates a shell command when the job runs, after the loop has moved on
            "python -m {params.module} --params {params.file:q}{params.job} --log {log:q}"
