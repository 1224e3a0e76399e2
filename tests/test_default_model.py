"""The embedded default model (jaxinfer/default_model) against transformers.

Oracles: transformers' ``AutoModelForCausalLM`` loading the shipped directory itself (its FP8 integration
dequantizes on CPU; exact here because every FP8 dimension is a multiple of 128, which ``test_checkpoint_format``
checks), an HF ``MtpLayer`` holding the exactly dequantized layer-N tensors (hf_oracle.MtpOracle, DeepSeek-V3
report sec. 2.2), and transformers' ``AutoTokenizer`` on the shipped tokenizer files (no extra arguments).
Token ids: the start of a held-out pydoc topic. Metric: float32 max|jaxinfer - HF| / max|HF| <= 1e-4.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import hf_oracle as O
from compile_counter import CompileCounter
from fp8_oracle import dequantize_checkpoint

from jaxinfer.default_model import path as default_model_path
from jaxinfer.engine.tokenizer import Tokenizer
from jaxinfer.train import data

transformers = pytest.importorskip("transformers")

F32_TOL = 1e-4
PATH = default_model_path()
HELDOUT_TOPIC = "dict"  # pydoc:dict is in the held-out split (test_heldout_ids_are_heldout)
MAX_BYTES = 16 * 2**20


def _tokenizer() -> Tokenizer:
    return O.cached("default_model:tokenizer", lambda: Tokenizer.from_dir(PATH))


def _heldout_ids(length: int = 96) -> np.ndarray:
    import pydoc_data.topics

    return np.asarray([_tokenizer().encode(pydoc_data.topics.topics[HELDOUT_TOPIC])[:length]], np.int32)


def _hf_model():
    def build():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(PATH), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        return model.eval()

    return O.cached("default_model:hf", build)


def test_path_is_the_package_directory():
    import importlib.resources

    assert PATH.is_dir() and (PATH / "config.json").is_file()
    assert (importlib.resources.files("jaxinfer.default_model") / "model.safetensors").is_file()


def test_heldout_ids_are_heldout():
    assert data.is_heldout(data.Document(f"pydoc:{HELDOUT_TOPIC}", ""))


def test_checkpoint_format():
    files = sorted(p.name for p in PATH.iterdir() if p.is_file() and p.suffix != ".py")
    assert files == ["TRAINING.md", "config.json", "expert_load.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    assert sum((PATH / f).stat().st_size for f in files) <= MAX_BYTES
    cfg = O.read_config(PATH)
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    # every DeepSeek-V3 feature on
    assert cfg["q_lora_rank"] and cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["first_k_dense_replace"] >= 1
    assert cfg["n_group"] > 1 and cfg["topk_group"] < cfg["n_group"] and cfg["topk_method"] == "noaux_tc"
    assert cfg["n_routed_experts"] >= 16 and cfg["n_shared_experts"] >= 1 and cfg["num_nextn_predict_layers"] == 1

    tensors = O.read_tensors(PATH)
    fp8 = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    n = cfg["num_hidden_layers"]
    assert f"model.layers.{n}.eh_proj.weight" in fp8 and "model.layers.1.mlp.experts.15.up_proj.weight" in fp8
    for name in fp8:  # multiples of 128: no partial blocks, so transformers' FP8 dequantization is exact
        assert all(d % 128 == 0 for d in tensors[name].shape), (name, tuple(tensors[name].shape))
        assert tensors[name + "_scale_inv"].dtype == torch.float32
    for name, t in tensors.items():
        if name in fp8 or name.endswith("_scale_inv"):
            continue
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, (name, t.dtype)
    # the MTP layer's copies of the embedding and the head are left out (they equal the main model's)
    assert not [k for k in tensors if re.match(rf"model\.layers\.{n}\.(embed_tokens|shared_head\.head)\.", k)]

    loads = json.loads((PATH / "expert_load.json").read_text())
    moe_layers = [i for i in range(n) if i >= cfg["first_k_dense_replace"]]
    assert loads["moe_layers"] == moe_layers
    expected = loads["tokens"] * cfg["num_experts_per_tok"]
    for layer in loads["expert_load"] + loads["mtp_expert_load"]:
        assert len(layer) == cfg["n_routed_experts"] and sum(layer) == expected
    assert len(loads["expert_load"]) == len(moe_layers) and len(loads["mtp_expert_load"]) == 1


def test_logits_match_transformers():
    ids = _heldout_ids()
    model = O.load_jax_model(PATH, "float32")
    assert model.has_mtp
    ref = O.reference_logits(_hf_model(), ids)
    got = model.logits(ids)
    err = O.rel_err(got, ref)
    # trained, not random: the held-out text is far more likely than under a uniform distribution
    logits = got[0, :-1].astype(np.float64)  # predicting ids[0, 1:]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = float((logz - logits[np.arange(len(logits)), ids[0, 1:]]).mean())
    print(f"\n[default model f32 T={ids.shape[1]}] max|diff|/max|ref| = {err:.3e}; held-out NLL {nll:.2f} nats")
    assert err <= F32_TOL
    assert nll < 0.75 * np.log(model.config.vocab_size)


def test_mtp_matches_oracle():
    """jaxinfer's MTP logits vs an HF MtpLayer holding the checkpoint's exactly dequantized layer-N tensors, on
    top of transformers' own main model."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf = _hf_model()
    n = hf.config.num_hidden_layers
    layer = MtpLayer(hf.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=n, use_post_norm=True).eval()
    oracle = O.MtpOracle(main=hf, layer=layer)
    pre = f"model.layers.{n}."
    O.load_mtp_tensors(oracle, {k: v for k, v in dequantize_checkpoint(O.read_tensors(PATH)).items()
                                if k.startswith(pre)})
    seq = _heldout_ids(65)
    ids, next_ids = seq[:, :-1], seq[:, 1:]
    model = O.load_jax_model(PATH, "float32")
    got = model.mtp_logits(ids, next_ids)
    err = O.rel_err(got, oracle.logits(ids, next_ids))
    acc = float((got[0, :-1].argmax(-1) == seq[0, 2:]).mean())  # token after next
    print(f"\n[default model MTP f32 T={ids.shape[1]}] max|diff|/max|ref| = {err:.3e}; top-1 (t+2) {acc:.2f}")
    assert err <= F32_TOL
    assert acc > 0.1


@pytest.mark.parametrize("text", [
    "Return a new dictionary initialized from an optional positional argument.",
    "  def f(x):\n\treturn x ** 2  # 12345\r\n",
    "中文, émoji 😀, and <｜end▁of▁sentence｜> as plain text",
])
def test_tokenizer_matches_transformers(text):
    hf = O.cached("default_model:hf_tok", lambda: transformers.AutoTokenizer.from_pretrained(str(PATH)))
    ours = _tokenizer()
    cfg = O.read_config(PATH)
    assert ours.bos_token_id == hf.bos_token_id == cfg["bos_token_id"] == 0
    assert ours.eos_token_id == hf.eos_token_id == cfg["eos_token_id"] == 1
    if "<｜" not in text:  # transformers turns special-token strings in text into special tokens; ours does not
        assert ours.encode(text) == hf.encode(text)
    ids = ours.encode(text)
    assert ids[0] == ours.bos_token_id and ours.decode(ids) == text


def test_chat_template_matches_transformers():
    hf = O.cached("default_model:hf_tok", lambda: transformers.AutoTokenizer.from_pretrained(str(PATH)))
    ours = _tokenizer()
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a dict?"},
                {"role": "assistant", "content": "A mapping."}, {"role": "user", "content": "And a set?"}]
    text = ours.render_chat(messages)
    assert text == ("<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>What is a dict?<｜Assistant｜>A mapping."
                    "<｜end▁of▁sentence｜><｜User｜>And a set?<｜Assistant｜>")
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    hf_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids if isinstance(hf_ids, list) else hf_ids["input_ids"])
    assert ours.apply_chat_template(messages) == hf_ids
    assert not ours.render_chat(messages[:2], add_generation_prompt=False).endswith("<｜Assistant｜>")


def test_llm_default_generates_what_transformers_generates():
    """LLM() without a model serves the embedded one; greedy float32 tokens equal transformers' generate (its own
    cache, eos_token_id=None) on the shipped directory; the default (bfloat16) engine runs text and chat."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(dtype="float32", mesh="1x1")  # the engine `jaxinfer generate` builds (test_cli_generate): shared programs
    assert llm.model_path == str(PATH)
    prompts = ["The with statement is used to", "Return a new dictionary"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = out.prompt_token_ids  # encoded in one batch (Tokenizer.encode_batch)
        hf_tok = O.cached("default_model:hf_tok", lambda: transformers.AutoTokenizer.from_pretrained(str(PATH)))
        assert out.prompt == prompt and ids == hf_tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = _hf_model().generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                       eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        assert out.outputs[0].text == _tokenizer().decode(out.outputs[0].token_ids)

    bf16 = LLM(mesh="1x1", num_kv_pages=8)
    out = bf16.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"
    messages = [{"role": "user", "content": "What is a dict?"}]
    chat = bf16.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)
    assert chat[0].prompt_token_ids == _tokenizer().apply_chat_template(messages)
    assert 1 <= len(chat[0].outputs[0].token_ids) <= 4

    # A second engine of the same model and settings reuses the first one's step programs
    # (engine/step_program.py shared_program): it traces and compiles nothing and computes the same tokens.
    again = LLM(mesh="1x1", num_kv_pages=8)
    assert again.runner.program is bf16.runner.program
    with CompileCounter() as counter:
        compiles = counter.measure(lambda: out.extend(again.generate(
            prompts[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)))
    assert compiles == 0 and out[1].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert LLM(mesh="1x1", num_kv_pages=8, max_num_seqs=4).runner.program is not bf16.runner.program  # other rows
