"""Estimators: what a model should take, computed before (or without) running it.

- analytic: parameters, memory and FLOPs from an architecture config (the seeds' formulas; the claims stage);
- memory: the peak tensor memory of this pipeline's own fine-tuning and generation runs, predicted before they
  start (training_memory, generation_memory) and compared with the measurement of the same kind.
"""
