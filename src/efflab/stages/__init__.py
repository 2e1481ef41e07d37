"""The stages, one module each (a package where a stage is several parts: claims, report), each run as
`python -m efflab.stages.<stage>`. A stage imports the shared core (efflab.*), never another stage."""
