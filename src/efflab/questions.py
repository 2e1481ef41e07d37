"""The questions the report answers, one row each, as report.parts is for its parts: the key decisions.json files
it under (a prefix for a question asked per run: `merge:<run>`, `kv_quant:<variant>`), how it is asked, the stage
whose records answer it, its objective (what an answer must be, stated in decisions.json beside how it was
decided), the glance's label and where its table is. decisions.build answers them; the glance, its links, the
short glance's order and labels and decisions.json's `absent` list derive from this table, and `efflab compare` reads
which stage answers each finding. A key that is not a row fails loudly. In the core (a leaf: no imports) because the
report stage and the compare command both read it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    kind: str
    ask: str
    stage: str
    objective: str
    title: str
    link: str
    per_run: bool = False
    absent_said: bool = True  # decisions.json's `absent` names it where the run does not answer it


DETAILS = "details.md#"
QUESTIONS = (
    Question("quantize", "Which quantization scheme?", "quantize",
             "the least memory with perplexity within the tolerance and a task gate that does not fail",
             "Quantization", DETAILS + "quantization-scheme"),
    Question("finetune", "Which fine-tuning method?", "finetune",
             "per axis, the least peak memory, the shortest step and the lowest perplexity, each beating every other",
             "Fine-tuning", DETAILS + "fine-tuning-method"),
    Question("finetune_target", "Which fine-tune reaches the target loss first?", "finetune",
             "the least time to the validation-loss target, by the paired step times and with the warm-up steps",
             "Time to target", DETAILS + "time-to-target-run-by-run", absent_said=False),
    Question("inference", "Which inference variant?", "bench_inference",
             "faster than the base model with perplexity within the tolerance; the fastest where intervals separate",
             "Inference", DETAILS + "inference-variant"),
    Question("attention", "Which attention implementation?", "bench_attention",
             "faster than eager; the fastest where intervals separate", "Attention",
             DETAILS + "attention-implementation"),
    Question("speculative", "Which speculative decoding pays on this model?", "bench_inference",
             "faster than the model's own dynamic generation with its own greedy tokens", "Speculative decoding",
             "#inference-variants-greedy-fixed-length", absent_said=False),
    Question("kv_quant", "Which KV cache?", "bench_inference",
             "the least memory within the tolerance, generating no slower than 0.9× the full-precision cache; "
             "otherwise a trade: the MiB it saves for the speed it costs", "Quantized KV cache",
             "#inference-variants-greedy-fixed-length", per_run=True, absent_said=False),
    Question("serving", "Which serving method?", "bench_serving",
             "the highest throughput over naive by its paired burst ratio, where that is decided", "Serving",
             "#serving-naive-vs-static-vs-continuous-batching"),
    Question("capacity", "What fits the memory budget?", "capacity",
             "the largest measured batch and sequence that fit, per subject", "What fits",
             "#capacity-the-largest-batch-and-sequence-that-fit"),
    Question("merge", "Which merge route?", "merge",
             "the lowest mean KL to the adapter; the lowest perplexity where its interval separates", "Merge route",
             DETAILS + "merge-route", per_run=True, absent_said=False),
    Question("qat", "Fewest weight bits, quantized after training (ptq) or during it (qat)", "qat",
             "the fewest bits whose perplexity interval lies within the tolerance, after training and with QAT",
             "Fewest weight bits", "#quantization-aware-training-and-the-precision-range-test"),
    Question("prune", "Which pruning strategy?", "prune",
             "faster than the base model with perplexity within the tolerance", "Pruning", "#structured-pruning"),
)
BY_KIND = {q.kind: q for q in QUESTIONS}
ORDER = tuple(BY_KIND)


def kind_of(key: str) -> str:
    """A decisions.json key's question: `merge:qlora-r8` is the merge question."""
    return key.split(":", 1)[0]


def of(key: str) -> Question:
    """The row of a decisions.json key; a key with none fails loudly (a question the glance would drop)."""
    try:
        return BY_KIND[kind_of(key)]
    except KeyError:
        raise KeyError(f"decisions.json's question {key!r} is not in efflab.questions.QUESTIONS") from None


def asked_once() -> dict[str, str]:
    """The questions decisions.json's `absent` names where a run does not answer them, with the stage that would."""
    return {q.kind: q.stage for q in QUESTIONS if q.absent_said}


def asked(key: str) -> str:
    """A decisions.json key's question as it is asked there: a question asked per run names its run."""
    q = of(key)
    return f"{q.ask.removesuffix('?')} for {key.split(':', 1)[1]}?" if q.per_run else q.ask
