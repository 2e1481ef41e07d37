"""A warm process the pipeline's jobs fork from, so that each job does not pay the imports of torch, transformers,
peft and bitsandbytes again: 8-12 s of CPU per job on a 2-core CPU, a third of the default run's time there.

Snakemake starts it once per run (the Snakefile's onstart: `python -m efflab.zygote --socket PATH`) and names its
socket in EFFLAB_ZYGOTE. A job's command is unchanged, `python -m efflab.stages.<stage> ...`: the package
efflab.stages, imported first while Python locates the module, hands the command to the server (`delegate`), which
forks a child that runs the stage module as `__main__` with the job's arguments, environment, working directory and
standard streams; the command exits with the child's status, and a signal sent to the command reaches the child.
The child is a fresh process in all a stage measures: the server imported libraries and ran nothing (no tensors,
no threads, no CUDA), as the cells' forkserver does (measure.isolation).

Where forking is not safe or not wanted the command runs as always, in its own process: without EFFLAB_ZYGOTE
(dvc repro, a stage run by hand), inside a SLURM job (its resources are the job's), on a machine with an NVIDIA or
AMD GPU (a library that touches CUDA at import leaves forked children unable to initialise it), off Linux, or when the
server does not answer. Only the standard library and the preload lists (measure.preload, evaluation) are imported
here at module level: the client must stay light.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path

from . import evaluation
from .measure import preload

ENV = "EFFLAB_ZYGOTE"  # the server's socket, set by the Snakefile for the jobs it starts
CHILD_ENV = "EFFLAB_ZYGOTE_CHILD"  # set in a forked job: it never delegates again
# What the server imports before it forks any job: what the cells' forkserver imports (measure.preload), and lm-eval
PRELOAD = [*preload.PRELOAD, *evaluation.PRELOAD]


def why_not_fork() -> str | None:
    """Why jobs should not fork from a server on this machine, or None when they may."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.environ.get("SLURM_JOB_ID"):
        return "inside a SLURM job"
    if list(Path("/dev").glob("nvidia[0-9]*")):
        return "an NVIDIA GPU is present"
    if Path("/dev/kfd").exists():  # AMD's ROCm: torch.cuda is HIP there, with the same fork hazard
        return "an AMD GPU (ROCm) is present"
    return None


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(conn, [payload], list(fds))
    else:
        conn.sendall(payload)


def _receive(conn: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One length-prefixed JSON message (and up to `want_fds` file descriptors), or None at end of stream."""
    buf, fds = b"", []
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("!I", buf[:4])[0]:
        if want_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(conn, 65536, want_fds)
        else:
            chunk = conn.recv(65536)
        if not chunk:
            return None, fds
        buf += chunk
    return json.loads(buf[4:4 + struct.unpack("!I", buf[:4])[0]]), fds


def delegate(module: str, args: list[str]) -> int | None:
    """Run `python -m module args` in a child of the server named by EFFLAB_ZYGOTE: its exit status, or None
    when there is no server to ask (the caller then runs the module itself)."""
    path = os.environ.get(ENV)
    if not path or os.environ.get(CHILD_ENV) or why_not_fork():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _send(conn, {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
        started, _ = _receive(conn)
    except OSError:
        return None
    if started is None:
        return None
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Snakemake stopping the job stops the child
        signal.signal(sig, lambda s, _f: os.kill(started["pid"], s))
    done, _ = _receive(conn)
    if done is None:  # killed (SIGKILL: the OOM killer, a time limit): end the same way, for whoever waits on us
        print(f"efflab: the job process {started['pid']} ended without a status (killed)", file=sys.stderr)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return done["code"]


def _watch_client(conn: socket.socket) -> None:
    """In the child: the client gone (Snakemake killed the job with SIGKILL) ends the child too."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def serving(path: str | None) -> bool:
    """Whether a server answers on `path` (a client that connects and sends nothing costs it one idle child)."""
    if not path or not Path(path).is_socket():
        return False
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        return True
    except OSError:
        return False
    finally:
        conn.close()


def _run_job(conn: socket.socket) -> None:
    """In the forked child: take the job's streams, environment and directory, run its module, report the status."""
    request, fds = _receive(conn, want_fds=3)
    if request is None:  # a client that only asked whether the server is there (serving)
        os._exit(0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the job's working directory first
    os.environ.clear()
    os.environ.update(request["env"], **{CHILD_ENV: "1"})
    _send(conn, {"pid": os.getpid()})
    threading.Thread(target=_watch_client, args=(conn,), daemon=True).start()
    sys.argv = [request["module"], *request["args"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, (int, type(None))):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what a normal exit runs: multiprocessing's cleanup, logging's flush
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _send(conn, {"code": code})
        except OSError:
            pass
        os._exit(code)


def serve(path: str, preload: list[str] = PRELOAD) -> None:
    """Accept jobs on `path` until the process that started this server (Snakemake) is gone."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)  # jobs may connect while the imports below run: they wait for them, not redo them
    for name in preload:
        try:
            __import__(name)
        except Exception:  # a library that cannot load here is imported (and reported) by the job itself
            pass
    server.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the finished jobs
    try:
        while os.getppid() == parent:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the job's own subprocesses are waited for
                conn.settimeout(None)
                _run_job(conn)
            print(f"job process {pid}", flush=True)
            conn.close()
    finally:
        Path(path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.zygote", description=serve.__doc__)
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--preload", help="modules to import first, comma-separated (default: the libraries "
                                          "every stage uses)")
    args = parser.parse_args(argv)
    serve(args.socket, PRELOAD if args.preload is None else [m for m in args.preload.split(",") if m])


if __name__ == "__main__":
    main()
