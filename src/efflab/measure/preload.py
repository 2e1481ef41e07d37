"""What a process that forks work imports before it forks, by module name: the cells' forkserver without CUDA
(isolation.cell_preload) and the pipeline's job server (efflab.zygote, which adds lm-eval: evaluation.PRELOAD).

Names only, and nothing imported: the job server's client (efflab.stages, as a stage command starts) reads this
module and must stay light, and measure/ imports nothing above it."""

# torch, transformers' model and Trainer machinery, peft (bitsandbytes with it), pandas, and the efflab modules the
# stages' work runs through.
PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.generation", "transformers.trainer", "peft", "pandas", "efflab.cli", "efflab.models.modeling",
           "efflab.training", "efflab.measure.isolation", "efflab.measure.memory", "efflab.measure.timing"]
