"""Task evaluation with lm-evaluation-harness: efflab's local tasks on the user's validation split (task), lm-eval
run on a model efflab has already loaded (harness), and the paired per-document scores and quality gate
(scores). The evaluate stage and the qat job both evaluate through here."""
