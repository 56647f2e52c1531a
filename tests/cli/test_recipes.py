"""Recipes and the shared launcher: the shell's batch arithmetic (DP = WORLD / (TP x PP x CP), train_batch_size =
MICRO x GAS x DP), its error messages, the numbers in each recipe's header, and that the Python config accepts
the command the launcher builds. Dry runs only (THREED_DRY_RUN=1): nothing is started."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess

import pytest

from helpers import REPO
from threed.engine.resolved import resolve
from threed.cli.flags import parse_run_config
from threed.cli.recipe import RECIPE_VARS as RECIPE_TABLE

LAUNCH = REPO / "recipes" / "launch.sh"
MODEL_RECIPES = [
    "llama2_7b",
    "llama2_13b",
    "llama2_70b",
    "llama3_8b",
    "llama3_70b",
    "llama31_8b",
    "llama31_70b",
    "llama31_405b",
    "llama32_1b",
    "llama32_3b",
]
LAUNCH_TEXT = LAUNCH.read_text()
# The recipe variables (threed.cli.recipe's table, which the launcher reads), and the launcher's defaults (its
# VAR=${VAR-default} lines).
RECIPE_VARS = [v.name for v in RECIPE_TABLE if v.form != "env"]
DEFAULTS = {m[1]: m[3] for m in re.finditer(r"^([A-Z_]+)=\$\{(\w+)-([^}]*)\}$", LAUNCH_TEXT, re.M)}
# Supervised fine-tuning: full (every weight trained) and LoRA (issue 38: adapters on a frozen base, the layouts
# `threed plan --lora-rank 16` picks).
SFT_RECIPES = ["llama31_8b_sft", "llama31_70b_sft", "llama32_3b_sft", "llama31_8b_lora_sft", "llama31_70b_lora_sft"]
# Long context with context parallelism (CP > 1; issue 27).
CP_RECIPES = ["llama31_8b_128k", "llama31_70b_64k"]
SLURM_SCRIPTS = {
    "llama70b_tp8_pp4.sh": ("llama31_70b", 4),
    "llama8b_tp2_pp2.sh": ("llama31_8b", 1),
    "llama70b_sft_tp8_pp4.sh": ("llama31_70b_sft", 4),
    "llama405b_tp8_pp16.sh": ("llama31_405b", 32),
    "llama8b_128k_tp4_cp2.sh": ("llama31_8b_128k", 1),
    "llama70b_64k_tp8_pp2_cp4.sh": ("llama31_70b_64k", 8),
    "llama8b_lora_sft_tp1_pp1.sh": ("llama31_8b_lora_sft", 1),
    "llama70b_lora_sft_tp4_pp1.sh": ("llama31_70b_lora_sft", 4),
}


def launch(recipe: str, env: dict[str, str], *args: str, dry: bool = True) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for var in RECIPE_VARS + ["NNODES", "GPUS_PER_NODE", "NODE_RANK", "MASTER_ADDR", "THREED_ARGS"]:
        base.pop(var, None)
    full = {**base, **({"THREED_DRY_RUN": "1"} if dry else {}), **env}
    return subprocess.run(
        ["bash", str(LAUNCH), str(REPO / "recipes" / f"{recipe}.sh"), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@functools.cache
def dry_run_at(recipe: str, nodes: int) -> subprocess.CompletedProcess[str]:
    """The dry run of `recipe` at `nodes` x 8 GPUs, made once per process: the header and SFT checks read the same."""
    return launch(recipe, {"NNODES": str(nodes), "GPUS_PER_NODE": "8"})


def dry_numbers(out: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(DP|GAS|TRAIN_BATCH_SIZE)=(\d+)$", out, re.M)}


def train_argv(out: str) -> list[str]:
    command = shlex.split(re.search(r"^command: (.*)$", out, re.M)[1])
    return command[command.index("train") + 1 :]


def python_train_batch(out: str, world: int) -> int:
    """The Python side's own check of the same command: RunConfig.validate and DeepSpeed's train_batch_size, which
    counts the CP ranks of each data-parallel rank as data ranks (CP is folded into DeepSpeed's data axis) while the
    rows per step, what the launcher prints, count DP only."""
    cfg = parse_run_config(train_argv(out))
    cfg.validate(world)
    ds = resolve(cfg, world).ds_config["train_batch_size"]
    assert ds % cfg.parallel.cp == 0
    return ds // cfg.parallel.cp


# (nodes, gpus per node, TP, PP, MICRO, GAS, GLOBAL) -> (DP, GAS, train_batch_size)
GOOD = [
    ((4, 8, 8, 4, 1, "", "512"), (1, 512, 512)),  # the 70B layout
    ((8, 8, 8, 4, 1, "", "512"), (2, 256, 512)),  # DP grows with the nodes, GAS shrinks
    ((32, 8, 8, 16, 1, "", "1024"), (2, 512, 1024)),  # the 405B layout
    ((1, 8, 2, 2, 4, "4", ""), (2, 4, 32)),  # the tiny recipe on one node
    ((2, 4, 2, 2, 4, "4", ""), (2, 4, 32)),  # ... and on 2 nodes x 4: same world, same batch
    ((1, 8, 1, 1, 2, "3", ""), (8, 3, 48)),  # pure DP: DP = WORLD
    ((2, 8, 4, 2, 2, "8", "32"), (2, 8, 32)),  # GAS and GLOBAL both given and consistent
    ((1, 8, 2, 1, 1, "", ""), (4, 1, 4)),  # neither: GAS = 1
    ((3, 8, 8, 1, 2, "", "24"), (3, 4, 24)),  # 3 nodes
    ((8, 8, 8, 2, 1, "", "4", "2"), (2, 2, 4)),  # CP 2: DP = 64 / (8 x 2 x 2), not 64 / (8 x 2)
]
BAD = [
    (
        (3, 8, 8, 4, 1, "", "512"),
        ["WORLD = NNODES x GPUS_PER_NODE = 3 x 8 = 24", "TP x PP = 8 x 4 = 32", "multiple of 32 GPUs"],
    ),
    ((1, 6, 2, 2, 1, "1", ""), ["= 1 x 6 = 6 ranks is not divisible by", "TP x PP = 2 x 2 = 4"]),
    ((4, 8, 8, 4, 3, "", "512"), ["GLOBAL=512 is not divisible by MICRO x DP = 3 x 1 = 3", "multiple of 3"]),
    ((8, 8, 8, 4, 1, "", "511"), ["GLOBAL=511 is not divisible by MICRO x DP = 1 x 2 = 2", "DP = 64 / (8 x 4) = 2"]),
    (
        (1, 8, 2, 2, 4, "4", "64"),
        [
            "GAS=4 and GLOBAL=64 disagree",
            "MICRO x GAS x DP = 4 x 4 x 2 = 32, not 64",
            "GAS= GLOBAL=64, which gives GAS=8",
        ],
    ),
    ((1, 8, 0, 2, 4, "4", ""), ["TP must be a positive integer, got '0'"]),
    ((1, 8, 2, 2, "x", "4", ""), ["MICRO must be a positive integer, got 'x'"]),
    # CP: one sample takes TP x PP x CP ranks, DP excludes CP
    ((1, 8, 2, 2, 1, "1", "", "3"), ["= 1 x 8 = 8 ranks is not divisible by", "TP x PP x CP = 2 x 2 x 3 = 12"]),
    (
        (8, 8, 8, 2, 1, "", "3", "2"),
        ["GLOBAL=3 is not divisible by MICRO x DP = 1 x 2 = 2", "DP = 64 / (8 x 2 x 2) = 2"],
    ),
    ((1, 8, 2, 1, 1, "", "", "0"), ["CP must be a positive integer, got '0'"]),
]


def _env(nodes, gpus, tp, pp, micro, gas, glob, cp="1") -> dict[str, str]:
    # llama3.1-70b has 64 heads / 8 KV heads, so the Python side accepts every TP in the table.
    return {
        "CP": cp,
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(gpus),
        "TP": str(tp),
        "PP": str(pp),
        "MICRO": str(micro),
        "GAS": gas,
        "GLOBAL": glob,
        "MODEL": "llama3.1-70b",
        "SEQ": "128",
    }


@pytest.mark.parametrize("layout,expected", GOOD, ids=[str(g[0]) for g in GOOD])
def test_launcher_batch_arithmetic(layout, expected) -> None:
    out = launch("tiny", _env(*layout))
    assert out.returncode == 0, out.stderr
    dp, gas, batch = expected
    assert dry_numbers(out.stdout) == {"DP": dp, "GAS": gas, "TRAIN_BATCH_SIZE": batch}, out.stdout
    nodes, gpus, tp, pp, micro = layout[:5]
    cp = f" x cp {layout[7]}" if len(layout) > 7 else ""
    assert (
        f"tp {tp} x pp {pp}{cp} x dp {dp}; train_batch_size {batch} = micro {micro} x gas {gas} x dp {dp}" in out.stdout
    )
    argv = train_argv(out.stdout)
    assert argv[argv.index("--grad-accum-steps") + 1] == str(gas)
    assert argv[argv.index("--global-batch-size") + 1] == str(batch)
    assert python_train_batch(out.stdout, nodes * gpus) == batch
    torchrun = shlex.split(re.search(r"^command: (.*)$", out.stdout, re.M)[1])
    assert f"--nproc-per-node={gpus}" in torchrun and f"--nnodes={nodes}" in torchrun
    assert ("--standalone" in torchrun) == (nodes == 1)
    if nodes > 1:
        assert "--rdzv-backend=c10d" in torchrun


@pytest.mark.parametrize("layout,messages", BAD, ids=[str(b[0]) for b in BAD])
def test_launcher_rejects_inconsistent_layouts(layout, messages) -> None:
    out = launch("tiny", _env(*layout))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "command:" not in out.stdout
    err = " ".join(out.stderr.split())
    for m in messages:
        assert m in err, err


def test_python_config_rejects_what_the_shell_would() -> None:
    """The same inconsistency handed straight to `threed train` fails in the Python config too."""
    from threed.config import ConfigError

    cfg = parse_run_config(
        [
            "--model",
            "tiny",
            "--tp",
            "2",
            "--pp",
            "2",
            "--micro-batch-size",
            "4",
            "--grad-accum-steps",
            "4",
            "--global-batch-size",
            "64",
        ]
    )
    with pytest.raises(ConfigError, match=r"micro x gas x dp = 4 x 4 x 2 = 32"):
        cfg.validate(8)
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp"):
        cfg.validate(6)


def test_extra_flags_pass_through() -> None:
    out = launch("tiny", {"THREED_ARGS": "--seed 7"}, "--log-interval", "5")
    assert out.returncode == 0, out.stderr
    argv = train_argv(out.stdout)
    assert argv[-4:] == ["--seed", "7", "--log-interval", "5"]
    assert parse_run_config(argv).train.log_interval == 5


def test_missing_data_fails_before_starting() -> None:
    out = launch("tiny", {"DATA": "/nonexistent/tokens.bin", "GPUS_PER_NODE": "8"}, dry=False)
    assert out.returncode == 2 and "DATA=/nonexistent/tokens.bin not found" in out.stderr, out.stderr


def test_launcher_defaults_are_recipe_variables() -> None:
    assert set(DEFAULTS) < set(RECIPE_VARS), DEFAULTS
    assert not {"MODEL", "TP", "PP", "SEQ"} & set(DEFAULTS), "a recipe gives the model and its layout"


@pytest.mark.parametrize("name", MODEL_RECIPES + SFT_RECIPES + CP_RECIPES + ["tiny"])
def test_recipe_is_only_overridable_variables(name: str) -> None:
    """A recipe states only what differs from the launcher's defaults, each line overridable from the
    environment, in the launcher's order."""
    text = (REPO / "recipes" / f"{name}.sh").read_text()
    code = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    names = []
    for line in code:
        m = re.fullmatch(r"([A-Z_]+)=\$\{(\w+)-([^}]*)\}", line)
        assert m and m[1] == m[2], f"{name}: not a VAR=${{VAR-default}} line: {line!r}"
        assert m[3] != DEFAULTS.get(m[1], ""), f"{name}: {line!r} repeats the launcher's default"
        names.append(m[1])
    assert names == [v for v in RECIPE_VARS if v in names], f"{name}: not in the launcher's order (RECIPE_VARS)"
    assert {"MODEL", "TP", "PP", "SEQ", "DATA", "TOKENIZER", "SAVE"} <= set(names)
    # PACK is the SFT recipes' own (pretraining data is packed by GPTDataset already).
    assert ("PACK" in names) == (name in SFT_RECIPES)
    assert text.startswith("# "), "a header comment comes first"


def test_launcher_defaults_fill_in_and_clear() -> None:
    """What a recipe leaves out comes from the launcher's defaults; the environment overrides a default, and an
    empty value clears it (no flag: training's own default)."""
    argv = train_argv(launch("llama31_8b", {"GPUS_PER_NODE": "8"}).stdout)
    for flag, var in (
        ("--dtype", "DTYPE"),
        ("--warmup-steps", "WARMUP"),
        ("--steps", "STEPS"),
        ("--eval-interval", "EVAL_INTERVAL"),
        ("--eval-iters", "EVAL_ITERS"),
    ):
        assert argv[argv.index(flag) + 1] == DEFAULTS[var], (flag, argv)
    out = launch("llama31_8b", {"GPUS_PER_NODE": "8", "EVAL_INTERVAL": "", "STEPS": "7"})
    assert out.returncode == 0, out.stderr
    argv = train_argv(out.stdout)
    assert "--eval-interval" not in argv and argv[argv.index("--steps") + 1] == "7"


def _header_layout(text: str) -> tuple[int, int, int, int, int]:
    m = re.search(
        r"at (\d+) nodes? x 8 GPUs: DP = (\d+) / \(\d+ x \d+(?: x \d+)?\) = (\d+), GAS = .* = (\d+),\n"
        r"#\s+train_batch_size = MICRO x GAS x DP = \d+ x \d+ x \d+ = (\d+) sequences",
        text,
    )
    assert m, "header must spell out the batch arithmetic"
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


@pytest.mark.parametrize("name", MODEL_RECIPES + SFT_RECIPES + CP_RECIPES)
def test_recipe_header_matches_launcher_and_python(name: str) -> None:
    text = (REPO / "recipes" / f"{name}.sh").read_text()
    nodes, world, dp, gas, batch = _header_layout(text)
    assert world == nodes * 8
    out = dry_run_at(name, nodes)
    assert out.returncode == 0, out.stderr
    assert dry_numbers(out.stdout) == {"DP": dp, "GAS": gas, "TRAIN_BATCH_SIZE": batch}
    assert python_train_batch(out.stdout, world) == batch  # heads divide TP, seq fits, batch agrees
    # The header's memory figure is the estimator's at that layout.
    header_mem = re.search(r"^#\s+(~\d+ GB/GPU = [^\n]*)$", text, re.M)[1]
    launcher_mem = re.search(r"^memory: (.*)$", out.stdout, re.M)[1]
    assert launcher_mem.startswith(header_mem), (header_mem, launcher_mem)
    gb = int(re.match(r"~(\d+) GB", header_mem)[1])
    assert gb <= 72, f"{name}: {gb} GB per GPU leaves too little room on an 80 GB GPU"
    run = re.search(r"^# Run\s+sbatch (?:--nodes=\d+ )?(\S+)", text, re.M)[1]
    assert (REPO / run).is_file()


@pytest.mark.parametrize("name", SFT_RECIPES)
def test_sft_recipes_fine_tune_packed_from_converted_weights(name: str) -> None:
    """Weights from a converted HF checkpoint (not random), packing on, a fine-tuning learning rate that decays,
    and validation on a held-out split."""
    nodes = _header_layout((REPO / "recipes" / f"{name}.sh").read_text())[0]
    out = dry_run_at(name, nodes)
    assert out.returncode == 0, out.stderr
    argv = train_argv(out.stdout)
    assert argv[argv.index("--pack") + 1] == "true" and argv[argv.index("--init-from") + 1]
    cfg = parse_run_config(argv)
    assert cfg.data.pack and cfg.checkpoint.init_from and not cfg.checkpoint.load
    # LoRA's adapters take a learning rate about ten times a full fine-tune's
    top = 5e-4 if name.endswith("_lora_sft") else 5e-5
    assert 0 < cfg.train.lr <= top and cfg.train.min_lr < cfg.train.lr and 0 < cfg.train.warmup_steps < cfg.train.steps
    assert (cfg.lora.lora_rank > 0) == name.endswith("_lora_sft")
    assert cfg.train.eval_interval and cfg.data.split.split(",")[1] != "0"


def test_pretraining_recipes_leave_pack_unset() -> None:
    """PACK unset or empty: no --pack on the command line (training's default, false)."""
    for name, env in (("llama31_8b", {}), ("llama31_8b_sft", {"PACK": ""})):
        out = launch(name, {"GPUS_PER_NODE": "8", **env})
        assert out.returncode == 0, out.stderr
        assert "--pack" not in train_argv(out.stdout)
        assert not parse_run_config(train_argv(out.stdout)).data.pack


def test_model_override_scales_the_70b_recipe_down() -> None:
    env = {"NNODES": "4", "GPUS_PER_NODE": "8", "MODEL": "tiny-tp8", "SEQ": "64", "GLOBAL": "8"}
    out = launch("llama31_70b", env)
    assert out.returncode == 0, out.stderr
    assert dry_numbers(out.stdout) == {"DP": 1, "GAS": 8, "TRAIN_BATCH_SIZE": 8}
    cfg = parse_run_config(train_argv(out.stdout))
    assert (cfg.model.name, cfg.parallel.tp, cfg.parallel.pp, cfg.train.seq_length) == ("tiny-tp8", 8, 4, 64)
    cfg.validate(32)


@pytest.mark.parametrize("script", sorted(SLURM_SCRIPTS))
def test_slurm_scripts_match_their_recipes(script: str) -> None:
    recipe, nodes = SLURM_SCRIPTS[script]
    text = (REPO / "slurm" / script).read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", text, re.M))
    assert directives["nodes"] == str(nodes) and directives["ntasks-per-node"] == "1"
    assert directives["gres"] == "gpu:8" and "requeue" in directives
    assert re.fullmatch(r"B:USR1@\d+", directives["signal"])
    assert f"RECIPE=${{RECIPE:-recipes/{recipe}.sh}}" in text
    header_nodes = _header_layout((REPO / "recipes" / f"{recipe}.sh").read_text())[0]
    assert header_nodes == nodes


def test_shell_syntax() -> None:
    files = [LAUNCH, *(REPO / "slurm").glob("*.sh"), *(REPO / "recipes").glob("*.sh")]
    for f in files:
        out = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert out.returncode == 0, f"{f}: {out.stderr}"


def test_every_recipe_is_checked() -> None:
    """A recipe added to recipes/ without a place in the lists above would escape every header check."""
    on_disk = {p.stem for p in (REPO / "recipes").glob("*.sh")} - {"launch"}
    assert on_disk == set(MODEL_RECIPES + SFT_RECIPES + CP_RECIPES + ["tiny"])


def test_sequence_parallel_and_recompute_reach_the_command_line() -> None:
    """SEQUENCE_PARALLEL / RECOMPUTE_* become Megatron's flags (the bare --sequence-parallel), the training config
    and the dry run's memory line take them, and the environment turns them off."""
    out = launch("llama31_405b", {"NNODES": "32", "GPUS_PER_NODE": "8"})
    assert out.returncode == 0, out.stderr
    argv = train_argv(out.stdout)
    assert "--sequence-parallel" in argv and argv[argv.index("--sequence-parallel") + 1].startswith("--")
    for flag, value in (
        ("--recompute-granularity", "full"),
        ("--recompute-method", "block"),
        ("--recompute-num-layers", "1"),
    ):
        assert argv[argv.index(flag) + 1] == value, argv
    cfg = parse_run_config(argv)
    assert cfg.parallel.sequence_parallel and cfg.train.recompute_num_layers == 1
    assert cfg.train.recompute_method == "block" and not cfg.train.activation_checkpointing
    cfg.validate(256)
    off = launch(
        "llama31_405b",
        {
            "NNODES": "32",
            "GPUS_PER_NODE": "8",
            "SEQUENCE_PARALLEL": "false",
            "RECOMPUTE_GRANULARITY": "",
            "RECOMPUTE_METHOD": "",
            "RECOMPUTE_NUM_LAYERS": "",
        },
    )
    assert off.returncode == 0, off.stderr
    argv = train_argv(off.stdout)
    assert not {"--sequence-parallel", "--recompute-granularity", "--recompute-num-layers"} & set(argv)
    on_mem, off_mem = (re.search(r"^memory: ~(\d+) GB", o.stdout, re.M)[1] for o in (out, off))
    assert int(off_mem) > int(on_mem) + 40  # the dry run's estimate follows the flags (~130 GB without them)
    bad = launch("llama31_70b", {"NNODES": "4", "GPUS_PER_NODE": "8", "SEQUENCE_PARALLEL": "yes"})
    assert bad.returncode == 2 and "SEQUENCE_PARALLEL must be true or false" in bad.stderr
