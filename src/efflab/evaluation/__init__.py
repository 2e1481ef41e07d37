"""Task evaluation with lm-evaluation-harness: efflab's local tasks on the user's validation split (task), lm-eval
run on a model efflab has already loaded (harness), and the paired per-document scores and quality gate
(scores). The evaluate stage and the qat job both evaluate through here."""

# What a process that evaluates imports up front: the job server (zygote.PRELOAD adds it to measure.preload's), a
# stage whose cells evaluate (measure.isolation.prestart's extra). Here, so that zygote reads it without importing
# torch.
PRELOAD = ["lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.tasks"]
