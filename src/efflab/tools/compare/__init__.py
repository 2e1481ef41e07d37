"""`efflab compare RUN_A RUN_B`: what changed between two runs, finding by finding.

A run is a results folder with its report (or a kept reference, named by its folder under results/reference/). Its
findings are the report's ledger (report/statements.jsonl: every figure the report states, with its interval, n and
verdict) and its answers decisions.json's. Each finding both runs hold is set side by side (findings.pair): B over A
with an interval from both runs' intervals, and a verdict in the one vocabulary (improved, regressed, same within
±X%, not decided at this size), or `not comparable` with its reason: the finding's stage (or the model and data it
rests on) ran with other params, or it is an absolute figure (a time, a rate, MiB) of another machine or library
stack: across those only within-run ratios (a speedup over the run's own baseline, a perplexity change) are
compared. The page (page.write) lists the questions whose answer changed, with the params and versions that differ.
"""
