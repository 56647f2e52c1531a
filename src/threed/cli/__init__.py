"""The command lines: every argv -> config translation and every `threed` sub-command, in one vocabulary of flag
names (`flags.py`: generated from the config fields' metadata, with Megatron-LM's aliases).

    main.py            `threed ...`: the parser, the sub-commands, the one exit policy
    __main__.py        `python -m threed.cli ...` (what torchrun and recipes/launch.sh start)
    flags.py           argv <-> RunConfig; `add_field_flag` gives any command a training flag under its own name
    recipe.py          recipe variables (recipes/*.sh) <-> config fields: the one table recipes/launch.sh reads
    check_config.py    `threed check-config`: training's checks at a world size, the batch and the memory estimate
    convert.py         `threed convert | export | reshard | verify | make-tiny-hf`
    preprocess.py      `threed preprocess` (plain and --sft)
    memory.py          `threed memory` (also `python -m threed.memory`)
    plan.py            `threed plan`
    profile_layers.py  `threed profile-layers`
    report.py          `threed report`
    generate.py        `threed generate` (the checks; the ranks are threed.generate.run)
    eval_harness.py    `threed eval-harness` (the checks; the ranks are threed.harness.run)

Nothing below imports this package: a layer never knows which command called it.
"""
