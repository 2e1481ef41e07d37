"""Params that depend on the model are checked before anything runs: LoRA targets (by peft itself, on the
meta-device model), pruning strategies, attention implementations, quantization schemes and the QAT group size,
each refused in one line naming the key, the model and what it offers; for a local folder at the dry run, for a
hub id as soon as its config.json is in the local cache."""
from __future__ import annotations

import copy
import subprocess

import pytest
import yaml
from transformers import AutoConfig

from efflab import config
from efflab.config import UserError
from efflab.models import model_check
from tests.families import FAMILIES
from tests.helpers import BIN, REPO, TEST_PARAMS


@pytest.fixture(scope="module")
def params():
    return config.load(TEST_PARAMS)


def family_config(family: str):
    return AutoConfig.for_model(family, vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                **FAMILIES[family])


def problems(cfg: dict, family: str, edit) -> list[str]:
    cfg = copy.deepcopy(cfg)
    edit(cfg)
    return model_check.problems(config.validate(cfg), family_config(family))[0]


def test_the_ci_params_fit_the_families_whose_module_names_they_use(params):
    assert model_check.problems(params, family_config("llama")) == ([], [])
    assert model_check.problems(params, family_config("qwen2")) == ([], [])


def notes(cfg: dict, family: str, edit) -> list[str]:
    cfg = copy.deepcopy(cfg)
    edit(cfg)
    found, said = model_check.problems(config.validate(cfg), family_config(family))
    assert found == [], found
    return said


def test_lora_targets_the_model_lacks_are_a_note_naming_its_own_projections(params):
    """Not an error: the runs that use the setting are recorded unavailable with peft's reason; the rest run."""
    said = notes(params, "gpt2", lambda c: None)  # the CI params name Llama's q/k/v/o
    assert said and said[0].startswith("finetune.defaults.lora: GPT2LMHeadModel (gpt2): peft cannot adapt")
    assert "c_attn" in said[0] and "null" in said[0] and "unavailable" in said[0]


def test_null_targets_are_ones_every_family_can_take(params):
    """peft's default for the family, else the model's own projections (the MoE families with fused experts)."""
    def defaults(cfg):
        cfg["finetune"]["defaults"]["lora"]["target_modules"] = None
        cfg["bench_attention"]["implementations"] = ["eager"]
    for family in FAMILIES:
        assert [p for p in notes(params, family, defaults) if "lora" in p] == [], family


@pytest.mark.parametrize("family, own", [("mixtral", ["o_proj", "q_proj"]),
                                         ("deepseek_v3", ["kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"])])
def test_what_peft_cannot_wrap_is_said_before_training_with_the_model_s_own_modules(params, family, own):
    # A mixture of experts under all-linear: peft wraps the 3-D expert weights, which take no dropout.
    def moe(cfg):
        cfg["finetune"]["defaults"]["lora"] |= {"target_modules": "all-linear", "dropout": 0.05}
    said = [n for n in notes(params, family, moe) if "lora" in n]
    assert said and "peft cannot adapt" in said[0] and "dropout" in said[0]
    projections = said[0].split("its own projections are ")[1].split(" (")[0].split(", ")
    assert set(own) <= set(projections) and not {"base_layer", "default", "lm_head"} & set(projections), said[0]


def test_the_default_targets_of_a_family_peft_has_none_for_are_its_own_projections():
    from efflab.lora import lora_targets

    targets = lora_targets(family_config("deepseek_v3"), None)
    assert targets == ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
                       "up_proj"]  # the dense first layer's and the shared expert's MLP, not the routed experts
    assert lora_targets(family_config("llama"), None) == ["q_proj", "v_proj"]  # peft's own default


def test_a_strategy_that_keeps_more_heads_or_layers_than_there_are_is_refused(params):
    def too_many(cfg):
        cfg["prune"]["strategies"] = {"keep-9": {"keep_heads": 9}, "all-layers": {"remove_layers": 2}}
    found = problems(params, "llama", too_many)
    assert any(p.startswith("prune.strategies.keep-9: keeps 9 of the 4 query heads") for p in found)
    assert any(p.startswith("prune.strategies.all-layers: removes 2 of the 2 layers") for p in found)


def test_an_attention_implementation_the_family_lacks_is_a_note_naming_what_it_offers(params):
    """Not an error: the default list must work on any family; the job records unavailable, the dry run says so."""
    cfg = copy.deepcopy(params)
    cfg["bench_attention"]["implementations"] = ["eager", "sdpa", "sdpa_math"]
    cfg["finetune"]["defaults"]["lora"]["target_modules"] = None
    found, notes = model_check.problems(config.validate(cfg), family_config("gemma2"))
    from transformers import Gemma2ForCausalLM

    if Gemma2ForCausalLM._supports_sdpa:  # transformers 5.17 (the floor) still gives Gemma2 SDPA: nothing to say
        assert found == [] and notes == []
        return
    assert found == [] and notes == [
        "bench_attention.implementations: Gemma2ForCausalLM (gemma2) cannot take 'sdpa', 'sdpa_math' (it offers "
        "eager, flash_attention_2, flex_attention): recorded as unavailable"]
    assert model_check.check(cfg, "p.yaml", config=family_config("gemma2")) == notes


def test_a_qat_group_size_that_does_not_divide_a_layer_is_refused(params):
    found = problems(params, "llama", lambda c: c["qat"].update(group_size=48))
    assert found and found[0].startswith("qat.group_size: 48 does not divide the 64 input features")


@pytest.mark.integration  # real dry runs: ~28 s of a worker, make test keeps its 10 minutes
def test_the_dry_run_refuses_a_local_folder_or_a_cached_hub_id_the_params_do_not_fit(tmp_path):
    folder = tmp_path / "gpt2"
    family_config("gpt2").save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")  # a model folder has a tokenizer (efflab.models.model_folder.check)
    hub = tmp_path / "hub" / "models--efflab-test--tiny-gpt2"
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text("0" * 40)
    family_config("gpt2").save_pretrained(hub / "snapshots" / ("0" * 40))
    base = config.load(TEST_PARAMS)

    def dry_run(cfg: dict) -> subprocess.CompletedProcess:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
        return subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-n", "--cores", "1",
                               "--quiet", "rules"], cwd=tmp_path, capture_output=True, text=True,
                              env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path),
                                   "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})

    for source in (str(folder), "efflab-test/tiny-gpt2", "efflab-test/not-cached"):
        cfg = copy.deepcopy(base)
        cfg["base_model"] |= {"source": source, "config_overrides": {}}
        cfg["prune"]["strategies"] = {"keep-9": {"keep_heads": 9}}  # GPT-2 at test size has 4 heads
        proc = dry_run(cfg)
        if source.endswith("not-cached"):  # no config at hand: base_model checks it once downloaded
            assert proc.returncode == 0, proc.stderr[-2000:]
            continue
        assert proc.returncode == 1, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("efflab: error: params.yaml: prune.strategies.keep-9: keeps 9 of the 4 query heads of "
                               "GPT2LMHeadModel (gpt2)"), last
    # the CI params' LoRA targets (Llama's q/k/v/o) are not GPT-2's: a note, those runs unavailable, not an error;
    # and no library line on the console
    cfg["base_model"]["source"] = str(folder)
    proc = dry_run(cfg | {"prune": base["prune"]})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if not line.startswith("efflab: ")] == [], proc.stderr
    assert "efflab: note: params.yaml: finetune.defaults.lora: GPT2LMHeadModel (gpt2): peft cannot adapt" \
        in proc.stderr, proc.stderr


def test_the_check_raises_one_line_naming_the_first_problem_and_the_count(params):
    cfg = copy.deepcopy(params)
    cfg["qat"]["group_size"] = 48
    cfg["prune"]["strategies"] = {"keep-9": {"keep_heads": 9}}
    with pytest.raises(UserError, match=r"^p.yaml: prune.strategies.keep-9: .* \(and 1 more\)$"):
        model_check.check(cfg, "p.yaml", config=family_config("llama"))
