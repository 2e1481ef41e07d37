"""The stages, one module each (a package where a stage is several parts: claims, report), each run as
`python -m efflab.stages.<stage>`. A stage imports the shared core (efflab.*), never another stage.

Running a stage, Python imports this package first, while sys.argv[0] is still "-m": in a Snakemake run that
started a job server (efflab.zygote), the command is handed to it here, before the stage's own imports, and
exits with the job's status."""
import sys

if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv:
    _at = sys.orig_argv.index("-m")
    if sys.orig_argv[_at + 1:_at + 2] and sys.orig_argv[_at + 1].startswith(__name__ + "."):
        from .. import zygote

        _code = zygote.delegate(sys.orig_argv[_at + 1], sys.orig_argv[_at + 2:])
        if _code is not None:
            sys.exit(_code)
