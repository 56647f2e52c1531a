"""Chats and tokenizers built here (no hub) for the SFT tests: a Llama-3-style byte-level BPE tokenizer with Meta's
chat template, a Llama-2-style one with threed's LLAMA2_CHAT_TEMPLATE (or none), both trained on a small corpus, and
three conversations in the record shapes `threed preprocess --sft` reads (prompt / response, with a system prompt,
and a messages list of several turns)."""

from __future__ import annotations

from threed.data.chat import LLAMA2_CHAT_TEMPLATE

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Tell me a joke about pipelines.",
    "Why did the stage wait? It had a bubble.",
    "hello world 123 !?",
    "Explain tensor parallelism briefly.",
    "Split each matrix across GPUs and all-reduce the results.",
] * 20

CONVERSATIONS = [
    {"prompt": "What is the capital of France?", "response": "The capital of France is Paris."},
    {"prompt": "  hello world  ", "response": " Paris! ", "system": "You are a helpful assistant."},
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a joke about pipelines."},
            {"role": "assistant", "content": "Why did the stage wait? It had a bubble."},
            {"role": "user", "content": "Explain tensor parallelism briefly."},
            {"role": "assistant", "content": "Split each matrix across GPUs and all-reduce the results."},
        ]
    },
]


def llama3_tokenizer(template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE if template else None,
    )


def llama2_tokenizer(template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        CORPUS + ["[INST] [/INST] <<SYS>> <</SYS>>"] * 5,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=LLAMA2_CHAT_TEMPLATE if template else None,
    )
