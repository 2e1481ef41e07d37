"""The job server (efflab.zygote): a stage command handed to it runs in a forked child with the command's
arguments, working directory, environment and streams, and exits with the child's status; without a server the
command runs itself, the same."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from efflab import zygote

pytestmark = pytest.mark.skipif(zygote.why_not_fork() is not None, reason=f"no job server here: {zygote.why_not_fork()}")


@pytest.fixture
def server(tmp_path):
    path = tmp_path / "z.sock"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "efflab.zygote", "--socket", str(path), "--preload", "json"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:  # waits for a start-up, times nothing
        time.sleep(0.05)
    yield {"path": path, "log": tmp_path / "server.log"}
    proc.terminate()
    proc.wait()
    log.close()


def stage(args: list[str], cwd, socket=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (zygote.ENV, zygote.CHILD_ENV)}
    if socket:
        env[zygote.ENV] = str(socket)
    return subprocess.run([sys.executable, "-m", "efflab.stages.prepare_data", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_stage_command_runs_in_a_child_of_the_server_with_its_arguments_directory_and_status(server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "params.yaml").write_text("runtime: {threads: 1\n")  # malformed: a user error, exit status 2
    own = stage(["--params", "params.yaml"], work)
    served = stage(["--params", "params.yaml"], work, server["path"])
    assert own.returncode == served.returncode == 2
    assert own.stderr.strip().splitlines()[-1] == served.stderr.strip().splitlines()[-1]
    assert "params.yaml" in served.stderr and "Traceback" not in served.stderr
    assert "job process" in server["log"].read_text(), "the server did not fork the job"
    helped = stage(["--help"], work, server["path"])
    assert helped.returncode == 0 and "--params" in helped.stdout


def test_without_an_answering_server_the_command_runs_itself(tmp_path):
    gone = stage(["--help"], tmp_path, tmp_path / "no-such.sock")
    assert gone.returncode == 0 and "--params" in gone.stdout
