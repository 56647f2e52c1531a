"""The training wing: the loop and what runs beside it.

    loop.py       `threed train` / `python -m threed.train` (__main__.py): build the run, step, evaluate, save,
                  stop on request (preemption, time budget) or divergence
    preflight.py  every check train runs before it builds (rank 0), shared with `threed check-config --paths`
    evaluate.py   validation as (sum, count) over the data-parallel ranks, per dataset of a blend
    guard.py      what stops a run: divergence, the time budget, a stop request, the watchdog (one all-reduce a step)

What it logs goes through `threed.metrics`; where a run starts and how it saves is `threed.checkpoint`.
"""
