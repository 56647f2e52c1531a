"""Local lm-eval tasks for the harness tests, written by the tests themselves (no hub, no stock task data): a
multiple-choice task (30 documents, 4 choices), a rolling-loglikelihood task (20 documents, some longer than
the tiny model's 128-token context, so the rolling windows matter) and a generate_until task (12 documents, 8 new
tokens, two stop strings), as YAML + JSONL under one folder.

    from harness_fixtures import write_tasks, OFFLINE_ENV
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = ("tiny_mc", "tiny_ppl")
GEN_TASK = "tiny_gen"  # generate_until (through `threed generate`'s loop): only the parity test runs it
# lm-eval's dataset loading fully offline; HF_DATASETS_CACHE is set per test to a folder of its own.
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
WORDS = (
    "the a river stone light city north old bright quiet house garden water fire small large green blue red "
    "runs falls sings holds opens closes under over near far before after and or but if when"
).split()

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

PPL_YAML = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["river", "stone"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tasks(root: Path, mc_docs: int = 30, ppl_docs: int = 20) -> Path:
    """The two tasks under `root` (the --include-path); data files by absolute path."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(root / "mc.jsonl", "w") as f:
        for _ in range(mc_docs):
            doc = {"question": _sentence(rng, rng.randint(3, 12)) + ":", "answer": rng.randint(0, 3)}
            doc["choices"] = [" " + _sentence(rng, rng.randint(1, 4)) for _ in range(4)]
            f.write(json.dumps(doc) + "\n")
    with open(root / "ppl.jsonl", "w") as f:
        for i in range(ppl_docs):
            f.write(json.dumps({"text": _sentence(rng, 8 if i % 4 else 150)}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for _ in range(12):
            f.write(json.dumps({"question": _sentence(rng, rng.randint(2, 9)), "answer": rng.choice(WORDS)}) + "\n")
    (root / "tiny_gen.yaml").write_text(GEN_YAML.format(data=root / "gen.jsonl"))
    (root / "tiny_mc.yaml").write_text(MC_YAML.format(data=root / "mc.jsonl"))
    (root / "tiny_ppl.yaml").write_text(PPL_YAML.format(data=root / "ppl.jsonl"))
    return root


def model_dir(out: Path, config: dict, tokenizer_dir: str, seed: int = 0) -> Path:
    """A random HF Llama of `config` saved with the tokenizer files of `tokenizer_dir` beside it (a model directory
    as a user has one)."""
    import shutil

    from convert_fixtures import save_hf

    hf = save_hf(out, config, seed=seed)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, hf / f.name)
    return hf


def add_greedy_choices(root: Path, model_path: Path, every: int = 3) -> int:
    """Make choice 0 of every `every`-th multiple-choice document the model's own greedy next token (decoded), so
    that some requests are greedy and "is greedy" is compared on True as well as False. Returns how many."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    docs = [json.loads(line) for line in (root / "mc.jsonl").read_text().splitlines()]
    for doc in docs[::every]:
        with torch.no_grad():
            logits = model(torch.tensor([tok.encode(doc["question"])])).logits[0, -1]
        doc["choices"][0] = tok.decode([int(logits.argmax())])
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return len(docs[::every])


def request_results(results: dict) -> dict[str, list]:
    """Per task, each document's responses (lm-eval's log_samples `resps`): [(log-prob, is greedy)] per choice for
    multiple choice, [log-prob] for rolling."""
    return {
        task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }
