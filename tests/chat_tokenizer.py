"""A tokenizer directory carrying DeepSeek's chat, tool-call and reasoning tokens, for the chat protocol's tests.

A small byte-level BPE trained here (no network) on Python's `pydoc_data.topics` text, as tests/engine/
test_tokenizer.py trains its own; special tokens: DeepSeek-V3's BOS, EOS, `<｜User｜>`, `<｜Assistant｜>` and its nine
tool-call tokens; `<think>` / `</think>` (as in DeepSeek-R1) and Hermes / Qwen's `<tool_call>` / `</tool_call>` as
non-special added tokens. The chat template is vLLM's DeepSeek-V3 tool template, or its V3.1 one
(tests/data/README.md).
"""

import json
import pathlib

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
               "<｜tool▁output▁end｜>"]
TEMPLATE = (pathlib.Path(__file__).parent / "data" / "tool_chat_template_deepseekv3.jinja").read_text()
TEMPLATE_V31 = (pathlib.Path(__file__).parent / "data" / "tool_chat_template_deepseekv31.jinja").read_text()


def save(directory: pathlib.Path, template: str = TEMPLATE) -> pathlib.Path:
    """Writes tokenizer.json and tokenizer_config.json (chat_template: ``template``) into ``directory`` (created if
    needed); returns it."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    lines = [line for text in pydoc_data.topics.topics.values() for line in text.splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # DeepSeek's tokenizer.json adds no BOS itself
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=[BOS, EOS, USER, ASSISTANT, *TOOL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines[:3000], trainer=trainer)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
              "clean_up_tokenization_spaces": False, "tokenizer_class": "LlamaTokenizerFast",
              "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return directory
