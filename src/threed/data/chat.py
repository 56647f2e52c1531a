"""Chat records -> token ids and a response-only loss mask, for `threed preprocess --sft` (`threed.data.sft`).

A record is `{"prompt": ..., "response": ...}` (one user turn, one assistant turn; an optional "system") or
`{"messages": [{"role": ..., "content": ...}, ...]}`. It is rendered with the tokenizer's own chat template
(`tokenizer_config.json`'s `chat_template`, as Llama 3 / 3.1 ship it): the token ids equal transformers'
`tokenizer.apply_chat_template(messages)`. A tokenizer without one needs `--chat-format llama2` (Llama 2 chat's
`[INST]` template, the one Meta's HF tokenizer ships). The mask has the tokens' length and is 1 exactly on the
assistant turns' tokens, their end-of-turn / EOS token included (found from the rendered text of each assistant
turn and the tokenizer's character offsets; a token that straddles the turn's first character counts as the
turn's). mask[t] says whether token t is a target: the loss of the prediction made at t-1 counts iff mask[t] is 1.

Refused with PreprocessError naming the record: a record of neither shape, an empty response, a role the template
does not know, a template that rejects the conversation, a tokenizer with no chat template and no --chat-format.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from threed.data.chunks import PreprocessError

CHAT_FORMATS = ("llama2",)
BASE_ROLES = ("system", "user", "assistant")
EXTRA_ROLES = ("tool", "ipython")  # Llama 3.1's tool roles: known when the template names them

# Llama 2 chat's template, as in meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def to_messages(record: Any, where: str) -> list[dict[str, str]]:
    """A record in either shape -> a list of {"role", "content"}; PreprocessError for anything else."""
    shapes = 'give {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}'
    if isinstance(record, dict) and "messages" in record:
        msgs = record["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise PreprocessError(
                f'{where}: "messages" must be a non-empty list of objects with string "role" and "content"; {shapes}'
            )
        messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise PreprocessError(f'{where}: "prompt" and "response" must be strings')
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
        if isinstance(record.get("system"), str):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        got = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
        raise PreprocessError(f"{where}: record has neither shape (got {got}); {shapes}")
    if not any(m["role"] == "assistant" for m in messages):
        raise PreprocessError(f"{where}: no assistant turn, so nothing to train on")
    for m in messages:
        if m["role"] == "assistant" and not m["content"].strip():
            raise PreprocessError(f"{where}: empty response (an assistant turn with no text)")
    return messages


class ChatRenderer:
    """Renders conversations to token ids and a loss mask with an HF fast tokenizer and a chat template."""

    def __init__(self, tokenizer: Any, chat_format: Optional[str] = None):
        self.tok = tokenizer
        if chat_format is not None and chat_format not in CHAT_FORMATS:
            raise PreprocessError(f"--chat-format {chat_format!r}: choose from {CHAT_FORMATS}")
        own = getattr(tokenizer, "chat_template", None)
        if chat_format == "llama2":
            self.template = LLAMA2_CHAT_TEMPLATE
        elif isinstance(own, str) and own:
            self.template = own
        elif isinstance(own, dict) and "default" in own:
            self.template = own["default"]
        else:
            raise PreprocessError(
                "the tokenizer has no chat template; pass --chat-format llama2 (Llama 2's [INST] "
                "format) or use a tokenizer whose tokenizer_config.json has a chat_template"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise PreprocessError(
                "--sft needs a fast HF tokenizer (tokenizer.json) for the response mask's character offsets"
            )
        self.roles = BASE_ROLES + tuple(r for r in EXTRA_ROLES if re.search(rf"['\"]{r}['\"]", self.template))

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def __call__(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        for m in messages:
            if m["role"] not in self.roles:
                raise PreprocessError(
                    f"{where}: role {m['role']!r} is not one the chat template knows ({', '.join(self.roles)})"
                )
        try:
            text = self._render(messages, False)
            spans = []  # character ranges of the assistant turns in `text`
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before, through = self._render(messages[:i], True), self._render(messages[: i + 1], False)
                if not text.startswith(through) or not through.startswith(before) or len(through) <= len(before):
                    raise PreprocessError(
                        f"{where}: the chat template does not render conversations "
                        f"incrementally, so the response span cannot be found"
                    )
                spans.append((len(before), len(through)))
        except PreprocessError:
            raise
        except Exception as e:  # jinja2 errors, raise_exception() of the template (e.g. roles not alternating)
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PreprocessError(f"{where}: the chat template rejects this conversation ({msg})") from None
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = [int(any(a < end and b > start for start, end in spans)) for a, b in offsets]
        return ids, mask


def load_hf_tokenizer(path: str) -> Any:
    if not Path(path).exists():
        raise PreprocessError(
            f"tokenizer not found: {path}; --sft needs a local HF tokenizer directory or tokenizer.json"
        )
    if Path(path).is_file() and path.endswith(".model"):
        raise PreprocessError(
            f"{path} is a sentencepiece model; --sft needs an HF fast tokenizer (a directory with "
            f"tokenizer.json, or a tokenizer.json)"
        )
    # transformers: heavy, only for --sft
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return (
            PreTrainedTokenizerFast(tokenizer_file=path)
            if Path(path).is_file()
            else AutoTokenizer.from_pretrained(path, local_files_only=True)
        )
    except Exception as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreprocessError(f"cannot load tokenizer {path} ({msg})") from None
