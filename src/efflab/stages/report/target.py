"""Time to quality: which fine-tune reaches the validation-loss target first, and at what memory.

The target is finetune.target.loss, or (auto) the base model's validation loss lowered by below_base_pct: the
step-0 loss of a run whose model before training is the base (validation_curve.starts_from_base). Each run's
time to it (quality.time_to_target) is put on its record once (with_targets), before any table or decision reads
it. Runs that differ only in their learning rate or seed are one method's sweep: the method is represented by
its run that reaches the target first (the learning rate chosen per method, as MLPerf's submitters tune theirs),
and the methods are compared by quality.first_to_target on the paired step times (records.step_ratio).
"""
from __future__ import annotations

import json

from ... import quality, records
from ...measure.timing import SENTINEL_TOLERANCE

SWEPT = ("learning_rate", "seed")  # settings a method's sweep varies: runs differing only in these are one method


def target_of(cfg: dict, finetune: list[dict]) -> dict | None:
    """The loss target and where it comes from; None where params.yaml sets none."""
    t = cfg["finetune"].get("target")
    if not t:
        return None
    if t["loss"] != "auto":
        return {"loss": float(t["loss"]), "source": "finetune.target.loss"}
    curves = [r["validation_curve"] for r in records.ok(finetune) if r.get("validation_curve")]
    if not curves:
        return {"loss": None, "source": "auto", "why": "no run recorded a validation curve (these records were made "
                "without finetune.target)"}
    base = next((c["points"][0]["loss"] for c in curves if c.get("starts_from_base")), None)
    if base is None:
        return {"loss": None, "source": "auto", "why": "no run starts from the base model's weights (a full "
                "fine-tune, or LoRA with a no-op init): set finetune.target.loss"}
    return {"loss": base * (1 - t["below_base_pct"] / 100), "source": "auto", "base_loss": base,
            "below_base_pct": t["below_base_pct"]}


def with_targets(cfg: dict, finetune: list[dict]) -> list[dict]:
    """The finetune records, each with its time to the target (`time_to_target`, the target under its "target"):
    what every table, sentence and decision reads."""
    target = target_of(cfg, finetune)
    if not target or target["loss"] is None:
        return finetune

    def timed(r: dict) -> dict:
        curve = r.get("validation_curve") if records.is_ok(r) else None
        if not curve:
            return r
        return r | {"time_to_target": quality.time_to_target(curve["points"], target["loss"], r.get("step_time"))
                    | {"target": target}}
    return [timed(r) for r in finetune]


def sweep_key(r: dict) -> str:
    """What a run is apart from its learning rate and seed: runs with one key are one method's sweep."""
    return json.dumps({k: v for k, v in (r.get("settings") or {}).items() if k not in SWEPT}, sort_keys=True,
                      default=str)


def question(cfg: dict, finetune: list[dict], bench_finetune: list[dict] = ()) -> dict | None:
    """decisions.json's time-to-target question: per method (its sweep's first run), steps and time to the target
    with their interval, the peak memory it trained at, and the run that reaches it first where that is decided.
    `finetune`: the records with_targets timed."""
    runs = [r for r in records.ok(finetune) if r.get("time_to_target")]
    if not runs:
        target = target_of(cfg, finetune)
        return {"answer": None, "options": [],
                "why": target["why"], "target": target, "baseline": None, "frontier": []} \
            if target and target.get("why") else None
    target = runs[0]["time_to_target"]["target"]
    sweeps: dict[str, list[dict]] = {}
    for r in runs:
        sweeps.setdefault(sweep_key(r), []).append(r)
    options = [_option(group) for group in sweeps.values()]
    by_name = {r["run"]: r for r in runs}
    # ranked on the one step-time comparison the knob table and the fine-tuning decision read (interleaved, else
    # paired step by step, else the runs' own at one machine speed: records.step_ratio gives why not otherwise)
    answer, why = quality.first_to_target({o["name"]: o["time"] for o in options}, lambda a, b: records.step_ratio(
        by_name[a], by_name[b], bench_finetune, SENTINEL_TOLERANCE))
    return {"baseline": None, "answer": answer,
            "why": why, "target": target, "frontier": [], "options": options}


def _first(t: dict) -> tuple:
    return (not t["reached"], t["time_s"] if t["time_s"] is not None else float("inf"))


def over_seeds(times: list[dict]) -> dict:
    """One learning rate's time to target over its seeds (runs that differ in the seed alone): the median seed's
    (a seed that never reached it counting as never, as MLPerf counts it), its interval from the fastest seed's
    lower end to the slowest's upper end (open where a seed did not reach it), n the seeds."""
    if len(times) == 1:
        return times[0]
    ranked = sorted(times, key=_first)
    mid = ranked[(len(ranked) - 1) // 2]
    reached = [t for t in ranked if t["reached"]]
    lows = [t["lo"] for t in ranked if t["lo"] is not None]
    base = {"seeds": len(times), "n": len(times), "steps_each": [t["steps"] for t in times]}
    if not mid["reached"]:
        return mid | base | {"why": f"not reached by the median of {len(times)} seeds", "lo": min(lows or [None])}
    return mid | base | {"lo": min(lows) if len(lows) == len(times) else None,
                         "hi": max(t["hi"] for t in reached) if len(reached) == len(times) and
                         all(t["hi"] is not None for t in reached) else None}


def _option(group: list[dict]) -> dict:
    """A method's sweep: its learning rates, each over its seeds; the rate that reaches the target first."""
    rates: dict[object, list[dict]] = {}
    for r in group:
        rates.setdefault(r["settings"].get("learning_rate"), []).append(r)
    timed = {lr: over_seeds([r["time_to_target"] for r in runs]) for lr, runs in rates.items()}
    lr = min(timed, key=lambda k: _first(timed[k]))
    best = rates[lr][0]
    memory = (best.get("train_memory") or {})
    return {"name": best["run"], "method": best["method"], "time": timed[lr], "learning_rate": lr,
            "swept": {r["run"]: r["settings"].get("learning_rate") for r in group} if len(rates) > 1 else None,
            "seeds": [r["run"] for r in rates[lr]] if len(rates[lr]) > 1 else None,
            "memory": {"value": memory.get("peak_mib"), "kind": memory.get("kind")},
            "init": (best.get("lora_init") or {}).get("init"), "optimizer": best.get("optimizer")}
