"""Oracle for greedy constrained outputs: each output token is the argmax of the model's cache-free logits
(``Model.logits`` over prompt + outputs, no KV cache, no engine) over the tokens llguidance allows after the earlier
ones, with the masks recomputed here token by token by a fresh matcher; the grammar is complete at the end."""

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jaxinfer.engine.structured_output import grammar_text


def assert_masked_argmax_chain(llm, constraints, outputs) -> None:
    """constraints: one StructuredOutputsParams per output; outputs: the RequestOutputs of greedy requests."""
    model, tok = llm.engine.model, llm.tokenizer
    vocab = model.config.vocab_size
    lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=vocab, eos_token=tok.eos_token_id)
    final = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    width = max(map(len, final))
    every = np.asarray(model.logits(np.array([f + [0] * (width - len(f)) for f in final])))  # [B, width, V]
    for i, (c, o) in enumerate(zip(constraints, outputs)):
        logits = every[i, len(o.prompt_token_ids) - 1:]  # row j: the logits of output token j
        matcher = llguidance.LLMatcher(lltok, grammar_text(c), log_level=0)
        words = llg_numpy.allocate_token_bitmask(1, vocab)
        for j, token in enumerate(o.outputs[0].token_ids):
            llg_numpy.fill_next_token_bitmask(matcher, words)
            allowed = np.unpackbits(words[0].view(np.uint8), bitorder="little")[:vocab] > 0
            assert token == int(np.where(allowed, logits[j], -np.inf).argmax()), (c.kind, j)
            assert matcher.consume_token(token)
        assert matcher.is_stopped(), c.kind
