"""Planning a run before it starts: which layout is fastest and fits (the memory model itself is `threed.memory`).

    planner.py    `threed plan`'s search: every (tp, pp, micro, gas, sp, schedule, recompute) layout, fitting or not,
                  ranked by predicted step time
    layout.py     one candidate layout, the table and the verdicts the planner prints
    steptime.py   the step-time model: compute, TP / DP / PP communication, the schedule's bubble
    profile.py    `threed profile-layers`: measured forward + backward cost per layer kind -> costs:...

The command lines are `threed.cli.plan` and `threed.cli.profile_layers`.
"""
