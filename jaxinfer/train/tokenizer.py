"""A byte-level BPE tokenizer trained with ``tokenizers``, saved as DeepSeek's tokenizer files.

Layout follows DeepSeek-V3's release: byte-level BPE (every byte is a token, so any text encodes), special tokens
``<｜begin▁of▁sentence｜>`` (id 0) and ``<｜end▁of▁sentence｜>`` (id 1) as in V3, then ``<｜User｜>`` and
``<｜Assistant｜>``; digits are split into runs of at most 3 before the byte-level split (V3's pre-tokenizer does
the same). Differences, on purpose: the BOS is added by tokenizer.json's own post-processor instead of
tokenizer_config's ``add_bos_token`` (transformers 5 ignores that key when a tokenizer.json exists, see
jaxinfer/engine/tokenizer.py), so jaxinfer's Tokenizer and transformers' AutoTokenizer agree without arguments;
and the chat template is V3's reduced to system / user / assistant turns.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)  # ids 0..3

# DeepSeek-V3's template (tokenizer_config.json of deepseek-ai/DeepSeek-V3), simplified: system prompts right
# after BOS, then "<｜User｜>{content}" and "<｜Assistant｜>{content}<｜end▁of▁sentence｜>" per turn, and
# "<｜Assistant｜>" when a generation prompt is asked for. No tool calls.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('only system, user and assistant roles are supported') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` tokens in all (4 special + 256 bytes + merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json: special tokens, the chat template (no add_bos_token: see the module docstring)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir, model_max_length: int) -> None:
    """Writes tokenizer.json and tokenizer_config.json into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
