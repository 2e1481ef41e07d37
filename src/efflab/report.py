"""Stage report: gather every stage's metrics.json with pandas into tables, plots and one CSV."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import cli  # noqa: E402

log = logging.getLogger("efflab")
MiB = 2**20


def load_metrics(layout, stage: str, names: list[str] | None) -> list[dict]:
    return [json.loads(layout.metrics(stage, n).read_text()) for n in (names or [None])]


def _mem(m: dict | None) -> float | None:
    return None if not m else m.get("peak_mib")


def quantize_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "scheme": r["scheme"], "method": r["method"], "double quant": r["double_quant"],
        "bnb layers": ", ".join(r["bnb_layer_types"]) or "-",
        "footprint (MiB)": r["memory_footprint_bytes"] / MiB, "x smaller than baseline": r["footprint_ratio_vs_base"],
        "on disk (MiB)": r["bytes_on_disk"] / MiB, "load (s)": r["load_s"],
        "val perplexity": r["validation"]["perplexity"], "perplexity change (%)": r["perplexity_change_pct"],
    } for r in rows])


def finetune_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "method": r["method"], "precision": r["mixed_precision"],
        "trainable params": r["parameters"]["trainable"], "trainable (%)": r["parameters"]["trainable_pct"],
        "total params": r["parameters"]["total"], "steps": r["steps"], "step (s)": r["step_s"],
        "tokens/s": r["tokens_per_s"], f"peak memory (MiB, {r['train_memory']['kind']})": _mem(r["train_memory"]),
        "val loss before": r["validation_before"]["loss"], "val loss after": r["validation_after"]["loss"],
        "val perplexity after": r["validation_after"]["perplexity"],
    } for r in rows])


def merge_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "reference": r["reference"], "merged into": r["merge_target"],
        f"max |logit diff| (merge dtype)": r["merged"]["max_abs_logit_diff"],
        "max |logit diff| (saved folder)": r["merged_saved"]["max_abs_logit_diff"], "saved dtype": r["saved_dtype"],
        "perplexity adapter": r["adapter_validation"]["perplexity"],
        "perplexity merged": r["merged"]["validation"]["perplexity"],
        "perplexity saved": r["merged_saved"]["validation"]["perplexity"],
    } for r in rows])


def attention_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        for row in r["rows"]:
            ok = row["status"] == "ok"
            out.append({
                "implementation": row["implementation"], "seq len": row["seq_len"], "batch": row["batch_size"],
                "status": row["status"] if ok else f"unavailable: {row['reason']}",
                "median (ms)": 1000 * row["latency"]["median"] if ok else None,
                "p90 (ms)": 1000 * row["latency"]["p90"] if ok else None,
                "tokens/s": row["tokens_per_s"] if ok else None,
                "peak delta (MiB)": row["memory"].get("delta_mib") if ok else None,
                "memory kind": row["memory"]["kind"] if ok else None,
                "max |diff| vs eager": row["max_abs_diff_vs_eager"] if ok else None,
            })
    return pd.DataFrame(out)


def inference_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "variant": r["variant"], "kind": r["kind"], "of": r["of"] or "-",
        "TTFT median (ms)": 1000 * r["ttft"]["median"], "TTFT p90 (ms)": 1000 * r["ttft"]["p90"],
        "decode tokens/s median": r["decode_tokens_per_s"]["median"],
        "decode tokens/s p90": r["decode_tokens_per_s"]["p90"],
        "per-token p50 (ms)": 1000 * r["per_token_latency"]["median"],
        "per-token p90 (ms)": 1000 * r["per_token_latency"]["p90"],
        f"peak (MiB, {r['memory']['kind']})": _mem(r["memory"]),
        "footprint (MiB)": r["memory_footprint_bytes"] / MiB,
    } for r in rows])


def plot_quantize(df: pd.DataFrame, path: Path) -> None:
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.bar(df["scheme"], df["footprint (MiB)"], color="tab:blue", alpha=0.7, label="footprint")
    ax1.set_ylabel("model footprint (MiB)")
    ax2 = ax1.twinx()
    ax2.plot(df["scheme"], df["val perplexity"], "o-", color="tab:red", label="perplexity")
    ax2.set_ylabel("validation perplexity", color="tab:red")
    ax1.set_title("Quantization: memory bought vs perplexity paid")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(layout, runs: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        curve = pd.read_csv(layout.out("finetune", run) / "loss.csv")
        ax.plot(curve["step"], curve["loss"], marker=".", label=run)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (response tokens)")
    ax.set_title("Fine-tuning loss curves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attention(df: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, part in df[df["status"] == "ok"].groupby("implementation"):
        upper = part["p90 (ms)"] - part["median (ms)"]
        ax.errorbar(part["seq len"], part["median (ms)"], yerr=[[0] * len(part), upper], marker="o", capsize=3,
                    label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["seq len"].unique()))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("forward latency (ms, median; bar to p90)")
    ax.set_title("Attention implementations")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_inference(df: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    med = df["decode tokens/s median"]
    ax.bar(df["variant"], med, yerr=[[0] * len(df), (df["decode tokens/s p90"] - med).clip(lower=0)],
           capsize=4, color="tab:green", alpha=0.8)
    ax.set_ylabel("decode tokens/s (median; bar to p90)")
    ax.set_title("Greedy generation by variant")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".4g")


def run(cfg: dict, paths: dict) -> dict:
    """Write summary.csv, report.md and the plots from every stage's metrics."""
    layout, out = paths["layout"], paths["out"]
    names = {s: cli.stage_names(cfg, s) for s in cli.STAGES}
    metrics = {s: load_metrics(layout, s, names[s]) for s in cli.STAGES if s != "report"}
    base, data = metrics["base_model"][0], metrics["prepare_data"][0]
    tables = {
        "quantize": quantize_table(metrics["quantize"]),
        "finetune": finetune_table(metrics["finetune"]),
        "merge": merge_table(metrics["merge"]),
        "bench_attention": attention_table(metrics["bench_attention"]),
        "bench_inference": inference_table(metrics["bench_inference"]),
    }
    plots = {"quantize.png": lambda p: plot_quantize(tables["quantize"], p),
             "finetune_loss.png": lambda p: plot_loss(layout, names["finetune"], p),
             "bench_attention.png": lambda p: plot_attention(tables["bench_attention"], p),
             "bench_inference.png": lambda p: plot_inference(tables["bench_inference"], p)}
    for file, draw in plots.items():
        draw(out / file)

    frames = [df.assign(stage=stage) for stage, df in tables.items()]
    pd.concat(frames, ignore_index=True).to_csv(out / "summary.csv", index=False)
    envs = {json.dumps({k: v for k, v in m["environment"].items() if k not in ("params_sha256", "torch_threads")},
                       sort_keys=True) for ms in metrics.values() for m in ms if "environment" in m}
    env = base["environment"]
    dtype_note = base.get("dtype_choice", {}).get("reason", f"{base['dtype']} as configured")
    lines = [
        "# efflab report", "",
        f"Model: `{base['source']}` ({base['model_type']}, {base['parameters']:,} parameters"
        f"{', random init' if base['random_init'] else ''}), compute dtype **{base['dtype']}** — {dtype_note}.",
        f"Data: `{data['source']}` — {data['train']['rows']} train / {data['validation']['rows']} validation rows, "
        f"template {data['template']}, loss on {'response tokens only' if data['mask_prompt'] else 'all tokens'}."
        + (f" {data['attribution']}" if data["attribution"] else ""),
        f"Measured on: {env['device']} — {env['cpu']} ({env['cpu_cores']} cores)"
        + (f", {env['gpu']}" if env.get("gpu") else "") + f"; torch {env['packages']['torch']}, "
        f"transformers {env['packages']['transformers']}, peft {env['packages']['peft']}, "
        f"bitsandbytes {env['packages']['bitsandbytes']}; commit {env['git_commit']}.",
        "" if len(envs) == 1 else "\n> **Warning:** these results come from more than one environment "
                                  f"({len(envs)} fingerprints); compare across stages with care.",
        "", "## Quantization (post-training, bitsandbytes)", "",
        "Footprint is `get_memory_footprint()` (parameters and buffers as loaded); perplexity on "
        f"{metrics['quantize'][0]['validation']['rows']} validation rows; change is against the baseline scheme.", "",
        _md(tables["quantize"]), "", "![quantization](quantize.png)", "",
        "## Fine-tuning: full vs LoRA vs QLoRA", "",
        "Tokens/s counts real (non-padding) tokens; peak memory is of the training loop, kind named in the column.",
        "", _md(tables["finetune"]), "", "![loss curves](finetune_loss.png)", "",
        "## Merging adapters", "",
        "Reference: the adapter on the base it was trained against. Differences are max |logit| over "
        "every real token of the validation rows.", "", _md(tables["merge"]), "",
        "## Attention implementations", "", _md(tables["bench_attention"]), "",
        "![attention](bench_attention.png)", "",
        "## Inference variants (greedy, fixed length)", "",
        f"{metrics['bench_inference'][0]['new_tokens']} new tokens per prompt, "
        f"{metrics['bench_inference'][0]['prompts']} prompts × {metrics['bench_inference'][0]['repeats']} repeats "
        "after warmup. TTFT = prefill; decode tokens/s excludes the first token.", "",
        _md(tables["bench_inference"]), "", "![inference](bench_inference.png)", "",
        "### Sample answers (first prompt)", "",
        *[f"- **{m['variant']}**: {m['samples'][0]['answer'].strip()[:200]!r}" for m in metrics["bench_inference"]],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    log.info("report: %s", paths["final"] / "report.md")
    return {"tables": {k: len(v) for k, v in tables.items()}, "plots": sorted(plots),
            "environments": len(envs)}


if __name__ == "__main__":
    cli.main("report", run)
