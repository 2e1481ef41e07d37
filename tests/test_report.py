import pandas as pd
import torch

from efflab import measure, report


def _envs():
    here = measure.environment(torch.device("cpu"))
    there = here | {"packages": here["packages"] | {"torch": "2.12.0"}, "cpu": "Other CPU"}
    there["fingerprint"] = measure.fingerprint(there)
    return here, there


def test_results_from_different_environments_are_not_put_in_one_table_unless_asked():
    here, there = _envs()
    assert here["fingerprint"] != there["fingerprint"]
    envs = {e["fingerprint"]: e for e in (here, there)}
    df = pd.DataFrame([{"variant": "a", "tokens/s": 10.0, "env": here["fingerprint"]},
                       {"variant": "b", "tokens/s": 12.0, "env": there["fingerprint"]}])
    refused = report.comparison(df, envs, allow_mixed=False)
    assert "Not compared in one table" in refused and "allow_mixed_environments" in refused
    assert f"torch: {here['packages']['torch']} / 2.12.0" in refused and "Other CPU" in refused
    assert refused.count("| variant") == 2, "one table per environment"
    combined = report.comparison(df, envs, allow_mixed=True)
    assert combined.count("| variant") == 1 and "combined" in combined
    same = report.comparison(df.assign(env=here["fingerprint"]), envs, allow_mixed=False)
    assert same.count("| variant") == 1 and "env" not in same


def test_missing_values_print_as_a_dash():
    table = report._md(pd.DataFrame([{"a": 1.5, "b": None}, {"a": float("nan"), "b": "x"}]))
    assert "nan" not in table and "-" in table.splitlines()[-1]
