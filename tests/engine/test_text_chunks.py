"""Long texts encoded in parallel pieces (engine/text_chunks.py, Tokenizer.encode / encode_batch) give exactly the
ids of encoding them whole (tokenizers' own encode is the oracle), on the embedded model's tokenizer (digit split +
GPT-2's byte-level regex) and the chat tests' tokenizer (with non-special added tokens), for texts built to sit on
the regexes' edges: runs of newlines and spaces, digits, punctuation before newlines, CJK, emoji, added tokens."""

import chat_tokenizer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.default_model import path as default_model_path
from jaxinfer.engine.text_chunks import can_cut
from jaxinfer.engine.tokenizer import Tokenizer

FRAGMENTS = ["word", "Word", " the", "  ", " ", "\n", "\n\n", "\n  ", "12345", "3.14", "'s", "?!", ".\n", "\t",
             "中文字符", "😀", "é", "<think>", "</think>", "<｜User｜>", "x" * 40]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    chat = Tokenizer.from_dir(chat_tokenizer.save(tmp_path_factory.mktemp("chat_tokenizer")))
    toks = [Tokenizer.from_dir(str(default_model_path())), chat]
    for tok in toks:
        tok.chunk_chars = 48  # many cuts in short texts
        tok.worker_min_chars = 0  # where malloc is limited to one arena (host_memory.py), as in this process, every
        # job goes to the worker processes (engine/tokenizer_workers.py)
    return toks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=20, max_size=200), st.booleans())
def test_pieces_encode_to_the_whole_texts_ids(tokenizers, fragments, add_special_tokens):
    text = "".join(fragments)
    for tok in tokenizers:
        want = tok._tok.encode(text, add_special_tokens=add_special_tokens).ids
        assert tok.encode(text, add_special_tokens) == want
        assert tok.encode_batch([text, text[:7]], add_special_tokens) == [
            want, tok._tok.encode(text[:7], add_special_tokens=add_special_tokens).ids]


def test_long_texts_are_cut(tokenizers):
    text = "A line of text.\nAnother line, with 123 digits.\n\n" * 40
    for tok in tokenizers:
        assert tok._cuttable and tok.encode(text) == tok._tok.encode(text).ids


def test_which_tokenizers_may_be_cut():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert can_cut({"normalizer": None, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated"}, byte_level]}})
    assert not can_cut({"normalizer": {"type": "NFC"}, "pre_tokenizer": byte_level})
    assert not can_cut({"normalizer": None, "pre_tokenizer": {**byte_level, "add_prefix_space": True}})
    assert not can_cut({"normalizer": None, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}})
    assert not can_cut({"normalizer": None, "pre_tokenizer": None})


def test_worker_processes_give_the_same_ids_and_a_dead_worker_falls_back(tokenizers):
    """Where malloc is limited to one arena (as in this process) a large job goes to worker processes
    (engine/tokenizer_workers.py): the same ids as tokenizers' own encode, for a long text cut in pieces and for a
    batch; a worker killed between jobs makes the next job encode here, with the same ids, and no worker is used
    again."""
    from jaxinfer import host_memory

    if not host_memory.ONE_ARENA:
        pytest.skip("malloc is not limited to one arena here: batches use tokenizers' thread pool")
    text = "".join(FRAGMENTS * 40)
    prompts = [text[i:i + 50] for i in range(0, 2000, 50)]
    for tok in tokenizers:
        if tok._workers is None:
            pytest.skip("one core: no worker processes")
        assert tok.encode(text) == tok._tok.encode(text).ids
        assert tok.encode_batch(prompts, False) == [tok._tok.encode(p, add_special_tokens=False).ids for p in prompts]
        assert len(tok._workers._procs) == tok._workers.n
        tok._workers._procs[0].kill()
        tok._workers._procs[0].wait()
        assert tok.encode_batch(prompts) == [tok._tok.encode(p).ids for p in prompts]
        assert tok._workers is None and tok.encode(text) == tok._tok.encode(text).ids
