"""The post-training quantization schemes, one row each: the library that quantizes with it, its weight bits, the
settings it takes besides `method`, the builder of its transformers config (a function of models.quantization) and
the analytic footprint that predicts its bytes (a function of estimators.analytic, or None where none is
modelled). The params checks, the quantize stage, model loading and the estimators read this table; a new scheme
is a row here and its name in the schema's `method` enum (tests/test_quantize.py holds the two equal).

No torch here: the params checks read it while Snakemake plans the DAG.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantScheme:
    method: str
    library: str  # the library that quantizes with it (its import name)
    bits: int | None  # weight bits; None: the scheme's own `bits` setting
    settings: frozenset[str] = frozenset()  # what a scheme of this method may set besides `method`
    builder: str = ""  # models.quantization.<builder>(quant, compute_dtype, device, calibration): its config
    footprint: str | None = None  # estimators.analytic.<footprint>(name, quant, compute_dtype, **overrides)
    config: str = ""  # the library's config class that is the scheme, where one is (torchao.quantization.<config>)


DEFAULT_BITS = 4  # hqq's and gptq's `bits` where a scheme leaves it out


def _table(*rows: QuantScheme) -> dict[str, QuantScheme]:
    return {row.method: row for row in rows}


SCHEMES = _table(
    QuantScheme("int8", "bitsandbytes", 8, builder="bnb_config", footprint="bnb_scheme_footprint"),
    QuantScheme("nf4", "bitsandbytes", 4, frozenset({"double_quant"}), "bnb_config", "bnb_scheme_footprint"),
    QuantScheme("fp4", "bitsandbytes", 4, frozenset({"double_quant"}), "bnb_config", "bnb_scheme_footprint"),
    QuantScheme("torchao-int8", "torchao", 8, builder="torchao_config", footprint="torchao_int8_footprint",
                config="Int8WeightOnlyConfig"),
    QuantScheme("torchao-int4", "torchao", 4, frozenset({"group_size"}), "torchao_int4_config",
                config="Int4WeightOnlyConfig"),
    QuantScheme("torchao-int8-dynamic", "torchao", 8, builder="torchao_config", footprint="torchao_int8_footprint",
                config="Int8DynamicActivationInt8WeightConfig"),
    QuantScheme("hqq", "hqq", None, frozenset({"bits", "group_size"}), "hqq_config"),
    QuantScheme("gptq", "gptqmodel", None, frozenset({"bits", "group_size", "calibration_rows"}), "gptq_config"),
)
FULL_PRECISION = "none"  # the method of the scheme that leaves the base model as it is


def scheme(quant: dict | None) -> QuantScheme | None:
    """The row of a scheme (params `quant`); None for full precision."""
    return None if not quant or quant["method"] == FULL_PRECISION else SCHEMES[quant["method"]]


def weight_bits(quant: dict | None) -> int | None:
    row = scheme(quant)
    return None if row is None else row.bits or quant.get("bits", DEFAULT_BITS)
