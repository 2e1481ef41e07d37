"""Every shell command the docs show can run: each line of a ```bash block in README.md and docs/ is run the way it
can be without doing its work, so that a command a reader would copy and that cannot run fails here.

- `snakemake ...`: Snakemake's own CLI, as written, in a scratch copy of the checkout with the CI params, its
  execution made a dry run after every check a real run makes (a missing `--cores`, an unknown rule, target,
  profile or flag fails);
- `make <target>`: `make -n` in the scratch copy (what the Makefile remakes even then lands there);
- `python -m efflab...`, `python <script>.py`, `mkdocs`, `accelerate`, `hf`: the command with `--help`;
- `dvc ...`: DVC's own argument parser, and every `-S` applied by DVC's own override code to a copy of params.yaml
  (a key params.yaml lacks is refused without `+`, as `dvc exp run` refuses it), then validated by the schema;
- `pytest`: its paths exist;
- programs that install, change the checkout or need this machine's hardware (pip, uv, git, nvidia-smi, ...): an
  explicit list, never run. Every path of the repository a command names must exist.

Each command runs once however many pages show it; the Python ones fork from one warm process
(tests/command_runner.py), two at a time."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import BIN, REPO, write_experiment

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*```(\S*)\s*$")
# Sample values for the placeholders the docs write as <name>.
PLACEHOLDERS = {"<rule>": "report"}
# Programs never run here, with why.
SKIPPED = {
    "pip": "installs packages", "pip3": "installs packages", "uv": "installs packages",
    "git": "changes the checkout", "cp": "copies a file", "rm": "deletes files", "cd": "a shell builtin",
    "export": "a shell builtin", "source": "a shell builtin", ".": "a shell builtin",
    "nvidia-smi": "needs an NVIDIA driver", "sacct": "needs a SLURM cluster", "grep": "reads this machine",
    "sort": "a filter", "bash": "runs a repository script (its path is checked)", "conda": "needs conda",
}
CONSOLE_SCRIPTS = {"mkdocs", "accelerate", "hf", "efflab"}
# Where a command names files of the repository, those must exist (outputs and the reader's own files, under
# results/, data/ or dist/, need not).
REPO_PATH = re.compile(r"^(workflow|tests|benchmarks|src|docs)/|^constraints[\w-]*\.txt$")
LEFT_OUT_OF_SCRATCH = {".git", ".snakemake", ".dvc", "results", "params.yaml", "dvc.lock", "site", "dist", "build",
                       ".pytest_cache", ".ruff_cache"}
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<"}
TIMEOUT = 180

# Commands that cannot run: the checks must say so.
BROKEN = ["snakemake --forcerun report",  # no --cores
          "snakemake --forcerun no_such_rule --cores all",
          "snakemake --profile workflow/profiles/no_such_profile",
          "make no-such-target",
          "python -m efflab.no_such_module",
          "dvc exp run --no-such-flag",
          "dvc exp run --temp -S finetune.defaults.no_such_key=1",
          "dvc exp run --temp -S finetune.runs.lora-r8.lora.r=16",  # a key params.yaml lacks: DVC wants +
          "no-such-program --help"]


@dataclass
class Command:
    text: str
    where: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Job:
    kind: str  # make, or a kind of tests/command_runner.py
    argv: tuple[str, ...]
    cwd: str
    env: tuple[tuple[str, str], ...] = ()

    def key(self):
        return self.kind, self.argv, self.env


def bash_lines(page: Path):
    """(line number, line) of every ```bash block of a page, continuation lines joined."""
    inside, lang, pending, start = False, "", "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            inside, lang = not inside, fence.group(1)
            continue
        if not inside or lang != "bash":
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a line, with comments, operators and redirections taken out."""
    for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current, skip = [], [], False
    for token in lexer:
        if skip:
            skip = False
        elif token in OPERATORS:
            commands.append(current)
            current = []
        elif token in REDIRECTS:
            skip = True  # its target
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


@cache
def documented() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for page in PAGES:
        for number, line in bash_lines(page):
            for tokens in split_commands(line):
                text = shlex.join(tokens)
                commands.setdefault(text, Command(text)).where.append(f"{page.relative_to(REPO)}:{number}")
    return commands


def scratch(root: Path) -> Path:
    """A folder that looks like the checkout to a command (its files linked, not copied), with the CI params as
    params.yaml and nothing of the checkout's results, venv or git."""
    work = Path(tempfile.mkdtemp(dir=root))
    for item in REPO.iterdir():
        if item.name not in LEFT_OUT_OF_SCRATCH and not item.name.startswith(".venv"):
            (work / item.name).symlink_to(item)
    write_experiment(work / "params.yaml")
    return work


def plan(tokens: list[str], root: Path) -> Job | str:
    """The job that checks a documented command, or why nothing runs. AssertionError where it cannot run."""
    env = {}
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    if tokens[:1] == ["sudo"]:
        tokens = tokens[1:]
    assert tokens, "only variable assignments"
    values = [t.split("=", 1)[1] if re.match(r"^[A-Z_]+=", t) else t for t in tokens]
    missing = [v for v in values if REPO_PATH.match(v) and not (REPO / v.split("::")[0]).exists()]
    assert not missing, f"names files the repository does not have: {missing}"
    unknown = re.findall(r"<[^<>\s]+>", " ".join(tokens))
    assert not unknown, f"a placeholder without a sample value in PLACEHOLDERS: {unknown}"
    program, args = tokens[0].removeprefix(".venv/bin/"), tokens[1:]
    env = tuple(sorted(env.items()))
    if "/" in program:
        return "a repository script (its path is checked)"
    if program in SKIPPED:
        return SKIPPED[program]
    if program == "snakemake":
        work = scratch(root)
        if shutil.which("conda") is None:  # --sdm conda needs conda itself to plan; the rest is checked
            for flag in ("--sdm", "--software-deployment-method"):
                i = args.index(flag) if flag in args else -1
                if i >= 0 and args[i + 1:i + 2] == ["conda"]:
                    args = args[:i] + args[i + 2:]
        if "--configfile" in args and not (work / args[args.index("--configfile") + 1]).exists():
            write_experiment(work / args[args.index("--configfile") + 1])  # the reader's own copy
        return Job("snakemake", tuple(args), str(work), env)
    if program == "make":
        return Job("make", ("make", "-n", *args), str(scratch(root)), env)
    if re.fullmatch(r"python(3(\.\d+)?)?", program):
        if args[:1] == ["-c"]:
            return "a one-line snippet about this machine's torch or GPU"
        if args[:2] in (["-m", "pip"], ["-m", "venv"]):
            return f"python -m {args[1]}: installs"
        if args[:1] == ["-m"]:
            return Job("module", (*args[1:], "--help"), str(scratch(root)), env)
        return Job("script", (*args, "--help"), str(scratch(root)), env)
    if program == "pytest":
        return "pytest: its paths are checked"
    if program == "dvc":  # parsed only, against the checkout's own params.yaml
        return Job("dvc", tuple(args), str(REPO), env)
    if program in CONSOLE_SCRIPTS:  # a subcommand's own flags, and accelerate's script arguments, aside
        return Job("entry", (program, *(args if program == "hf" else args[:1]), "--help"), str(scratch(root)), env)
    raise AssertionError(f"{program!r}: neither run by this test nor in its SKIPPED list (add it, with why)")


def run_make(job: Job) -> tuple[int, str]:
    done = subprocess.run(job.argv, cwd=job.cwd, env=os.environ | dict(job.env), capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def run_python(jobs: list[Job], root: Path) -> list[tuple[int, str]]:
    """The Python jobs, forked two at a time from one process that imported what they share."""
    if not jobs:
        return []
    logs = [Path(tempfile.mkstemp(dir=root, suffix=".log")[1]) for _ in jobs]
    spec = root / "jobs.json"
    spec.write_text(json.dumps([{"kind": j.kind, "argv": j.argv, "cwd": j.cwd, "env": dict(j.env), "log": str(log)}
                                for j, log in zip(jobs, logs)]))
    environment = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "command_runner.py"), str(spec), str(TIMEOUT)],
                          cwd=root, env=environment, capture_output=True, text=True, timeout=TIMEOUT * len(jobs),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"tests/command_runner.py failed:\n{done.stderr[-3000:]}"
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return [(code, log.read_text()[-3000:]) for code, log in zip(codes, logs)]


def check(texts: list[str], root: Path) -> dict[str, tuple[bool, str]]:
    """For each command, whether it can run and what to say. The same job runs once: two pages showing the same
    command, or two commands whose check is the same `--help`."""
    outcomes, jobs = {}, {}
    for text in texts:
        try:
            job = plan(shlex.split(text), root)
        except AssertionError as err:
            outcomes[text] = (False, str(err))
            continue
        if isinstance(job, str):
            outcomes[text] = (True, f"not run: {job}")
            continue
        jobs.setdefault(job.key(), (job, []))[1].append(text)
    python = [job for job, _ in jobs.values() if job.kind != "make"]
    results = dict(zip((job.key() for job in python), run_python(python, root)))
    results.update({job.key(): run_make(job) for job, _ in jobs.values() if job.kind == "make"})
    for key, (_, texts_of) in jobs.items():
        code, output = results[key]
        outcomes.update({text: (code == 0, output) for text in texts_of})
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every documented command, and the broken ones, checked once."""
    return check(list(documented()) + BROKEN, tmp_path_factory.mktemp("docs-commands"))


@pytest.mark.integration  # ~40 s of a worker: make test keeps its 10 minutes; CI runs it in make test-integration
@pytest.mark.parametrize("text", list(documented()))
def test_every_documented_command_can_run(text, outcomes):
    ok, said = outcomes[text]
    assert ok, f"`{text}` ({', '.join(documented()[text].where)}) cannot run:\n{said}"


@pytest.mark.integration
@pytest.mark.parametrize("text", BROKEN)
def test_a_command_that_cannot_run_fails_the_check(text, outcomes):
    ok, said = outcomes[text]
    assert not ok, f"`{text}` passed the check:\n{said}"


def test_the_docs_show_the_commands_a_reader_starts_with():
    texts = documented()
    for text in ("make run", "make test", "make install", "snakemake --forcerun report --cores all",
                 "snakemake --unlock --cores 1", "dvc commit -f"):
        assert text in texts, f"no ```bash block shows `{text}`"


def test_every_code_block_names_its_language():
    untagged = []
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            fence = FENCE.match(line)
            if fence:
                if not inside and not fence.group(1):
                    untagged.append(f"{page.relative_to(REPO)}:{number}")
                inside = not inside
    assert not untagged, f"code blocks without a language (```bash, ```yaml, ```python, ```text): {untagged}"
