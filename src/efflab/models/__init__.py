"""The model a user brings: its shape from its config (architecture), the checks of a local folder (model_folder)
and of the params against the model (model_check), loading it and its variants (modeling), quantizing it
(quantization), cutting its heads and layers (pruning) and the serving engines that load it (engines). Stages and
the estimators read it; it reads only the core below it (config, experiment, layout, measure)."""
