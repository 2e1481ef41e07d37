"""Peak memory of this pipeline's own fine-tuning and generation runs, predicted before they start, and each
prediction compared with its measurement. The predictions are training_memory's (fine-tuning) and
generation_memory's (greedy generation).

The prediction is of tensor bytes: what a run keeps alive on top of what is live when its measurement
starts (the loaded model). It is compared with the measurement of the same kind of memory: the peak of live
tensor bytes over those at the start, `cpu_tensor_peak` on CPU (from the CPU allocator's events) and
`cuda_max_allocated` on GPU. Resident memory (RSS) is compared too, as a second ratio: it also holds what
the allocator (glibc malloc) keeps after tensors are freed, so its ratio above 1 is the allocator's share,
not a tensor the estimate misses. Sizes are bytes; results are MiB.
"""
from __future__ import annotations

MiB = 2**20
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _ratio(measured, predicted):
    return measured / predicted if measured is not None and predicted else None


def compared(prediction: dict, memory: dict) -> dict:
    """The prediction with the measured peak of the same kind (live tensor bytes: `cpu_tensor_peak` on CPU,
    `cuda_max_allocated` on GPU) and measured/predicted beside it, and the resident-memory (RSS) delta and
    its ratio on CPU."""
    predicted = prediction.get("total_mib")
    if memory.get("kind") == "cpu_peak_rss":
        tensors = memory.get("tensors") or {}
        rss = memory.get("delta_mib")
        return prediction | {"measured_mib": tensors.get("delta_mib"), "measured_kind": tensors.get("kind"),
                             "ratio": _ratio(tensors.get("delta_mib"), predicted),
                             **({"measured_unavailable": tensors["unavailable"]} if "unavailable" in tensors else {}),
                             "rss_delta_mib": rss, "rss_ratio": _ratio(rss, predicted)}
    measured = memory.get("delta_mib")
    return prediction | {"measured_mib": measured, "measured_kind": memory.get("kind"),
                         "ratio": _ratio(measured, predicted)}
