"""Loading and validating params.yaml: the single experiment definition.

Defaults live in params.yaml; the JSON schema (workflow/schemas/params.schema.yaml) requires every
key, and the cross-checks below catch what a schema cannot express (names that refer to each other).
The schema also describes every key (`dvc exp run -S` rewrites params.yaml without its comments):
`python -m efflab.config describe [KEY]`.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import jsonschema
import yaml

from .evaluation.task import TASKS as EVAL_TASKS
from .evaluation.task import unknown_tasks
from .experiment import ADAPTER_METHODS, MODEL_KINDS, FinetuneRun, drafts_of, finetune_run, merge_runs
from .schema import UnknownKey, children, describe, descriptions, load_schema, parsed
from .schemes import SCHEMES

REPO_ROOT = Path(__file__).resolve().parents[2]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A last suffix of letters only (.csv, .jsonl, .gguf) names a file; a hub id's dot is usually a
# version (Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B).
FILE_SUFFIX = re.compile(r"\.[A-Za-z]+$")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class UserError(Exception):
    """Bad input from the user: reported as one line, never as a traceback."""


def missing_input(path) -> UserError:
    """The error for an earlier stage's output that a job needs and does not find (a stage run on its own)."""
    return UserError(f"{path} does not exist: expected the output of an earlier stage "
                     f"(run the pipeline up to this job, e.g. `snakemake --cores all`)")


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def schema_message(err: jsonschema.ValidationError) -> str:
    key = _key(err.absolute_path)
    if err.validator == "additionalProperties" and err.schema.get("additionalProperties") is False:
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        allowed = ", ".join(sorted(err.schema.get("properties", {})))
        return f"{key}: unknown key {extra[0]!r} (expected one of: {allowed})"
    if err.validator == "required":
        return f"{key}: {err.message}"
    if err.validator == "pattern" and "description" in err.schema:
        return f"{key}: {err.instance!r} is not valid: expected {err.schema['description']}"
    if err.validator == "enum":
        return f"{key}: {err.instance!r} is not one of {err.validator_value}"
    if err.validator in ("oneOf", "anyOf") and err.context:
        return f"{key}: {err.instance!r} is not valid: " + " or ".join(
            sorted({c.message for c in err.context}))
    return f"{key}: {err.message}"


def validate(cfg: dict, source: str = "params") -> dict:
    """Validate a parsed params dict; raise UserError naming the first offending key."""
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: expected a mapping of stage sections, got {type(cfg).__name__}")
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(cfg), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        raise UserError(f"{source}: {schema_message(errors[0])}")
    _cross_check(cfg, source)
    return cfg


def _check_scheme(quant: dict, where: str) -> None:
    takes = SCHEMES[quant["method"]].settings if quant["method"] in SCHEMES else frozenset()
    extra = sorted(set(quant) - {"method"} - takes)
    if extra:
        raise UserError(f"{where}.{extra[0]}: not a setting of method {quant['method']!r} (it takes "
                        f"{', '.join(sorted(takes)) or 'none'})")


# the optimizers bf16_weights replaces with torchao's AdamW (fp32 moments, stochastically rounded bf16 updates)
BF16_WEIGHTS_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def _check_bf16_weights(run: FinetuneRun, where: str) -> None:
    if not run.bf16_weights:
        return
    if run.optimizer not in BF16_WEIGHTS_OPTIMIZERS:
        raise UserError(f"{where}.optimizer: bf16_weights trains with torchao's AdamW (fp32 moments), which replaces "
                        f"{' or '.join(BF16_WEIGHTS_OPTIMIZERS)}; got {run.optimizer!r}")
    if run.mixed_precision == "fp16":
        raise UserError(f"{where}.mixed_precision: bf16_weights computes in bf16; expected auto, no or bf16, "
                        f"got 'fp16'")


def _check_optimizer(run: FinetuneRun, where: str) -> None:
    """A low-rank optimizer (GaLore, APOLLO) projects full weights' gradients: it has nothing to do on an adapter."""
    if run.optimizer.startswith(LOW_RANK_OPTIMIZERS) and run.method != "full":
        raise UserError(f"{where}.optimizer: {run.optimizer} projects the gradients of full weights; expected "
                        f"method full, got {run.method!r} (use adamw_* for an adapter)")


LOW_RANK_OPTIMIZERS = ("galore_", "apollo_")  # transformers' GaLore and APOLLO optimizers (training.LOW_RANK)


def _cross_check(cfg: dict, source: str) -> None:
    schemes = cfg["quantize"]["schemes"]
    runs = cfg["finetune"]["runs"]
    if cfg["report"]["baseline_scheme"] not in schemes:
        raise UserError(f"{source}: report.baseline_scheme: {cfg['report']['baseline_scheme']!r} "
                        f"is not a scheme in quantize.schemes ({', '.join(schemes)})")
    if schemes[cfg["report"]["baseline_scheme"]]["method"] != "none":
        raise UserError(f"{source}: report.baseline_scheme: expected a scheme with method 'none'")
    for name, scheme in schemes.items():
        _check_scheme(scheme, f"{source}: quantize.schemes.{name}")
    for name in runs:
        run = finetune_run(cfg, name)
        if run.method == "qlora" and run.quant["method"] not in ("nf4", "fp4"):
            raise UserError(f"{source}: finetune.runs.{name}.quant.method: QLoRA needs a 4-bit base "
                            f"(nf4 or fp4), got {run.quant['method']!r}")
        _check_bf16_weights(run, f"{source}: finetune.runs.{name}")
        _check_optimizer(run, f"{source}: finetune.runs.{name}")
    for name in cfg["merge"]["runs"] or []:
        if name not in runs or runs[name]["method"] not in ADAPTER_METHODS:
            raise UserError(f"{source}: merge.runs: {name!r} is not a lora/qlora run in finetune.runs")
    for task in cfg["qat"]["eval_tasks"]:
        if task not in cfg["evaluate"]["tasks"]:
            raise UserError(f"{source}: qat.eval_tasks: {task!r} is not in evaluate.tasks")
    unknown = unknown_tasks(cfg["evaluate"]["tasks"])
    if unknown:
        raise UserError(f"{source}: evaluate.tasks: {unknown[0]!r} is not an lm-eval task (efflab's own: "
                        f"{', '.join(EVAL_TASKS)}; `lm_eval ls tasks` lists the installed ones)")
    for name in cfg["evaluate"]["models"] or []:
        # a model this experiment does not make (a strategy or run not in its grid, a stage left out) is left out,
        # as the stage's own job is; a name of no kind of model is a mistake
        if name != "base" and name.split("-", 1)[0] not in list(MODEL_KINDS)[1:] or name.endswith("-"):
            raise UserError(f"{source}: evaluate.models: {name!r} is not a model this experiment makes "
                            f"(e.g. base, quantized-<scheme>, pruned-<strategy>, adapter-<run>, merged-<run>)")
    for name in cfg["capacity"]["runs"]:
        if name not in runs:
            raise UserError(f"{source}: capacity.runs: {name!r} is not a run in finetune.runs")
    for name in cfg["capacity"]["variants"]:
        if name not in cfg["bench_inference"]["variants"]:
            raise UserError(f"{source}: capacity.variants: {name!r} is not a variant in bench_inference.variants")
    for name, variant in cfg["bench_inference"]["variants"].items():
        _check_variant(cfg, f"{source}: bench_inference.variants.{name}", variant["kind"], variant.get("of"))
    _check_speculative(cfg, source)
    _check_slo_search(cfg, source)


def _check_slo_search(cfg: dict, source: str) -> None:
    """The SLO search's rate range runs upwards and its start lies in it."""
    o = cfg["bench_serving"].get("slo_search")
    if not o or not o["methods"]:
        return
    lowest, highest = o["range"]
    if not lowest < highest:
        raise UserError(f"{source}: bench_serving.slo_search.range: [{lowest:g}, {highest:g}] (expected [lowest, "
                        "highest] with lowest < highest, requests/s)")
    if not lowest <= o["start_rate"] <= highest:
        raise UserError(f"{source}: bench_serving.slo_search.start_rate: {o['start_rate']:g} (expected a rate in "
                        f"range [{lowest:g}, {highest:g}])")


def _check_speculative(cfg: dict, source: str) -> None:
    """Every assisted cell has a draft the params name, every draft a model this run makes or a source that exists;
    a quantized cache or a speculative mode has its settings."""
    b = cfg["bench_inference"]
    drafts = (b.get("speculative") or {}).get("drafts") or {}
    used = {d for v in b["variants"].values() for d in drafts_of(b, v) if d in drafts}
    for name, spec in drafts.items():
        if name not in used:  # no assisted cell loads it: a draft of a stage left out is no error
            continue
        key = f"{source}: bench_inference.speculative.drafts.{name}"
        if "source" in spec:
            classify_source(spec["source"], f"{key}.source")
        else:
            _check_variant(cfg, key, spec["kind"], spec.get("of"))
    for name, variant in b["variants"].items():
        key = f"{source}: bench_inference.variants.{name}"
        modes = variant.get("generation", b["generation"])
        for draft in variant.get("drafts", []):
            if draft not in drafts:
                raise UserError(f"{key}.drafts: {draft!r} is not a draft in bench_inference.speculative.drafts "
                                f"({', '.join(drafts) or 'none'})")
        if "assisted" in modes and not drafts_of(b, variant):
            raise UserError(f"{key}.generation: assisted needs a draft model (expected at least one in "
                            "bench_inference.speculative.drafts)")
        if {"prompt_lookup", "assisted"} & set(modes) and "speculative" not in b:
            raise UserError(f"{source}: bench_inference.speculative: needed by {name}'s speculative generation "
                            "(expected prompt_lookup_num_tokens, num_assistant_tokens and drafts)")
        if variant.get("kv_quant", b.get("kv_quant")) and "kv_quant_options" not in b:
            raise UserError(f"{source}: bench_inference.kv_quant_options: needed by {name}'s quantized KV cache "
                            "(expected residual_length, group_size, eval_rows, chunk and context_lengths)")


def _check_variant(cfg: dict, key: str, kind: str, of: str | None) -> None:
    """A variant's `of` names a model of its kind this experiment makes (experiment.MODEL_KINDS' of_names)."""
    names = MODEL_KINDS[kind].of_names
    if names is None:
        if of is not None:
            raise UserError(f"{key}.of: kind {kind!r} takes no 'of'")
        return
    if of is None:
        raise UserError(f"{key}.of: kind {kind!r} needs the name of one of {names}")
    runs = cfg["finetune"]["runs"]
    if kind in ("merged", "adapter") and (of not in runs or runs[of]["method"] not in ADAPTER_METHODS):
        raise UserError(f"{key}.of: {of!r} is not a lora/qlora run in finetune.runs")
    if kind == "merged" and of not in merge_runs(cfg):
        raise UserError(f"{key}.of: {of!r} is not merged (add it to merge.runs)")
    if of not in (lookup(cfg, names) or {}) and kind != "merged":
        raise UserError(f"{key}.of: {of!r} is not one of {names}")


EXTENDS = "extends"  # an overlay's key: the params file it carries its differences from


def load(path: str | Path) -> dict:
    """Read and validate a params file: a whole experiment, or an overlay that names the file it changes
    (`extends: FILE`, a path from the overlay's folder) and carries only its differences (overlay)."""
    return validate(_word_no(_resolved(Path(path), ())), str(path))


def files(path: str | Path) -> list[str]:
    """The params files an experiment is read from: `path`, then the file it extends, and so on."""
    chain, path = [], Path(path)
    while path is not None:
        chain.append(os.path.normpath(path))
        base = _read(path).get(EXTENDS)
        path = path.parent / base if isinstance(base, str) else None
    return chain


def _read(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: params file not found")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a mapping of stage sections, got {type(cfg).__name__}")
    return cfg


def _resolved(path: Path, seen: tuple[Path, ...]) -> dict:
    cfg = _read(path)
    if EXTENDS not in cfg:
        return cfg
    base = cfg.pop(EXTENDS)
    if not isinstance(base, str):
        raise UserError(f"{path}: {EXTENDS}: expected the path of the params file it overlays, got {base!r}")
    base_path = path.parent / base
    if base_path.resolve() in (*seen, path.resolve()):
        raise UserError(f"{path}: {EXTENDS}: {base} extends {path} in turn (a loop)")
    if not base_path.is_file():
        raise UserError(f"{path}: {EXTENDS}: {base}: params file not found (a path from {path.parent}/)")
    return overlay(_resolved(base_path, (*seen, path.resolve())), cfg)


def overlay(base: dict, changes: dict, nodes: list | None = None) -> dict:
    """`changes` over `base`: a mapping of settings (fixed keys in the schema: finetune.defaults) merges key by
    key; a grid of named entries (finetune.runs, quantize.schemes), a free mapping (config_overrides) and every
    other value is replaced whole, so an overlay says exactly which runs it has."""
    schema = parsed()
    nodes = [schema] if nodes is None else nodes
    keys, merged = children(schema, nodes), dict(base)
    for key, value in changes.items():
        subs = keys.get(key) or keys.get("<name>") or []
        below = children(schema, subs) if subs else {}
        settings = bool(below) and "<name>" not in below
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = overlay(base[key], value, subs) if settings and both else value
    return merged


def _word_no(node):
    """`mixed_precision: no` as the word it is. PyYAML reads YAML 1.1, where a bare `no` is False; DVC writes
    params.yaml back in YAML 1.2 (`dvc exp run -S`), which leaves the string "no" unquoted."""
    if isinstance(node, dict):
        return {k: "no" if k == "mixed_precision" and v is False else _word_no(v) for k, v in node.items()}
    return node


# The lm-eval metrics the tolerance section gates, in their own units (the rest of a task's metrics are reported,
# not gated); perplexity_pct is the tolerance of every perplexity change.
TASK_TOLERANCES = ("bits_per_byte", "chrf", "exact_match", "acc")


def task_tolerance(cfg: dict) -> dict[str, float]:
    """The tolerance of each gated lm-eval metric, in its own units: evaluate's gate and qat's task scores. Each
    is held to `tolerance.task_relative` of the reference model's score too, where that is less
    (evaluation.scores.tolerance_of)."""
    return {m: cfg["tolerance"][m] for m in TASK_TOLERANCES}


def task_relative(cfg: dict) -> float:
    """The share of the reference model's score a gated lm-eval metric may lose at most (tolerance.task_relative)."""
    return cfg["tolerance"]["task_relative"]


def lookup(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def classify_source(source: str, key: str) -> str:
    """'embedded', 'local' or 'hub' for a model or dataset source string.

    A relative path is relative to the working directory: the folder snakemake runs in (--directory),
    where it runs the stage commands too.
    """
    if source.startswith("embedded:"):
        return "embedded"
    path = Path(source).expanduser()
    if path.exists():
        return "local"
    if source.startswith(("/", ".", "~")) or FILE_SUFFIX.search(source):
        where = "" if path.is_absolute() else f" in {Path.cwd()}"
        raise UserError(f"{key}: {source!r} does not exist{where} (expected an existing local path, "
                        f"a hub id org/name, or an embedded: source)")
    if HUB_ID.match(source):
        return "hub"
    raise UserError(f"{key}: {source!r} is neither an existing path nor a hub id of the form org/name")


def local_source_files(stage: str, source: str) -> list[str]:
    """The local files a stage's `source` reads, so that editing one reruns the stage: [] for embedded
    and hub sources, the data file for prepare_data, the top-level files of the model folder for
    base_model (a folder's own mtime does not change when a file inside it is rewritten)."""
    key = f"{stage}.source"
    if classify_source(source, key) != "local":
        return []
    path = Path(source).expanduser()
    if stage == "prepare_data":
        if not path.is_file() or path.suffix not in DATA_SUFFIXES:
            raise UserError(f"{key}: {source!r} is not a data file (expected a {'/'.join(DATA_SUFFIXES)} file)")
        return [str(path)]
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: {source!r} is not a model folder (expected a folder with config.json)")
    return sorted(str(f) for f in path.iterdir() if f.is_file() and not f.name.startswith("."))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.config",
                                     description="What the params.yaml keys mean, and a params file's whole experiment.")
    commands = parser.add_subparsers(dest="command", required=True)
    describe_cmd = commands.add_parser("describe", help="print a key's description (no key: every key's, one a line)")
    describe_cmd.add_argument("key", nargs="?", help="a dotted key, e.g. finetune.defaults.packing")
    resolve_cmd = commands.add_parser("resolve", help="print a params file's whole experiment, its overlays merged")
    resolve_cmd.add_argument("file", help="a params file, e.g. tests/config/params.test.yaml")
    args = parser.parse_args(argv)
    try:
        if args.command == "resolve":
            print(yaml.safe_dump(load(args.file), sort_keys=False, width=120), end="")
        elif args.key is not None:
            print(describe(args.key))
        else:
            for key, text in descriptions().items():
                print(f"{key}: {text}")
    except (UnknownKey, UserError) as err:
        print(f"efflab config: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
