"""The embedded default model end to end: corpus -> tokenizer -> training -> FP8 export -> evaluation of the
exported checkpoint -> expert_load.json and TRAINING.md. ``scripts/train_tiny.py`` is its command line.

Deterministic for a given Python (the corpus is its own documentation), jax version and CPU: every random draw
comes from numpy generators seeded by ``TrainConfig.seed``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model import load_model
from jaxinfer.models.deepseek import DeepseekForCausalLM
from jaxinfer.train import data, evaluate, recipe
from jaxinfer.train.export import export_hf
from jaxinfer.train.step import Trainer, TrainConfig, init_model
from jaxinfer.train.tokenizer import BOS, EOS, save_tokenizer, train_tokenizer

SAMPLE_PROMPTS = ("The with statement is used to", "Return a new dictionary", "class Queue")
SAMPLE_TOKENS = 40


def single_device_module(model) -> DeepseekForCausalLM:
    """A loaded ``jaxinfer.Model`` (float32, FP8 dequantized, 1x1 mesh) as a plan-free module: same parameters, and
    the MoE layers then record their ``expert_load`` under nnx.capture."""
    abstract = nnx.eval_shape(lambda: DeepseekForCausalLM(model.config, rngs=nnx.Rngs(0), dtype=jnp.float32,
                                                          num_mtp_layers=model.layout["num_mtp_layers"]))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, nnx.to_pure_dict(model.state)))
    return nnx.merge(graphdef, state)


def build(out_dir, config: ModelConfig | None = None, tc: TrainConfig | None = None,
          log: Callable[[str], None] = print) -> dict:
    """Trains and writes the model into out_dir; returns the report (also written as TRAINING.md)."""
    config = config or recipe.model_config()
    tc = tc or recipe.train_config()
    out = pathlib.Path(out_dir)
    t_start = time.time()

    docs = data.corpus()
    train_docs, heldout_docs = data.split(docs)
    tok = train_tokenizer([d.text for d in train_docs], config.vocab_size)
    tok.encode_special_tokens = True  # corpus text never becomes a special token

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids

    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_stream = data.token_stream(train_docs, encode, bos, eos)
    heldout_stream = data.token_stream(heldout_docs, encode, bos, eos)
    log(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents, "
        f"{sum(len(d.text) for d in train_docs)} / {sum(len(d.text) for d in heldout_docs)} characters, "
        f"{len(train_stream)} / {len(heldout_stream)} tokens ({time.time() - t_start:.0f} s)")

    trainer = Trainer(init_model(config, tc.seed), tc)
    rng = np.random.default_rng(tc.seed)
    t_train = time.time()
    for step in range(1, tc.steps + 1):
        metrics = trainer.step(data.random_windows(train_stream, tc.batch, tc.seq_len + 2, rng))
        if step == 1 or step % 25 == 0 or step == tc.steps:
            m = {k: float(v) for k, v in metrics.items()}
            log(f"step {step}/{tc.steps}: loss {m['loss']:.3f} mtp {m['mtp_loss']:.3f} grad_norm "
                f"{m['grad_norm']:.2f} max_load/mean {m['max_load_ratio']:.2f} ({time.time() - t_train:.0f} s)")
    jax.block_until_ready(trainer.params)
    train_seconds = time.time() - t_train

    trained = trainer.model()
    f32 = evaluate.heldout_metrics(trained, heldout_stream, tc.seq_len)
    export_hf(config, trained, out)
    save_tokenizer(tok, out, config.max_position_embeddings)
    shipped = load_model(out, mesh="1x1", dtype="float32")
    metrics = evaluate.heldout_metrics(single_device_module(shipped), heldout_stream, tc.seq_len)
    unigram = evaluate.unigram_loss(train_stream, heldout_stream, config.vocab_size, tc.seq_len)
    write_expert_load(out / "expert_load.json", config, metrics)

    prompts = [[bos] + encode(p) for p in SAMPLE_PROMPTS]
    samples = evaluate.greedy(shipped.logits, prompts, SAMPLE_TOKENS)
    report = {
        "python": platform.python_version(), "jax": jax.__version__, "devices": jax.device_count(),
        "train_documents": len(train_docs), "heldout_documents": len(heldout_docs),
        "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
        "tokens_seen": tc.steps * tc.batch * tc.seq_len, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "heldout_loss": metrics.loss, "heldout_loss_before_fp8": f32.loss, "unigram_loss": unigram,
        "accuracy": metrics.accuracy, "mtp_loss": metrics.mtp_loss, "mtp_accuracy": metrics.mtp_accuracy,
        "scored_tokens": metrics.tokens,
        "checkpoint_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.suffix != ".py"),
        "samples": [(p, tok.decode(s)) for p, s in zip(SAMPLE_PROMPTS, samples)],
        "train_config": dataclasses.asdict(tc),
    }
    (out / "TRAINING.md").write_text(training_md(report, config))
    log(json.dumps({k: v for k, v in report.items() if k != "train_config"}, indent=1, ensure_ascii=False))
    return report


def write_expert_load(path: pathlib.Path, config: ModelConfig, metrics: evaluate.HeldoutMetrics) -> None:
    """Tokens routed to each logical expert on the held-out text: ``expert_load`` [num_moe_layers, E] for the main
    model's MoE layers in order (the shape of ``LLM.expert_load()``, EPLB's input), ``mtp_expert_load`` [1, E]."""
    main = [metrics.expert_load[("layers", i, "mlp")].tolist()
            for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    mtp = [metrics.expert_load[("mtp", k, "block", "mlp")].tolist() for k in range(config.num_nextn_predict_layers)]
    doc = {"description": "tokens routed to each logical expert (num_experts_per_tok choices per token) on the "
                          "held-out split", "tokens": metrics.tokens,
           "moe_layers": [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)],
           "expert_load": main, "mtp_expert_load": mtp}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def training_md(r: dict, config: ModelConfig) -> str:
    tc = r["train_config"]
    samples = "\n\n".join(f"Prompt `{p}`:\n\n```text\n{p}{s}\n```" for p, s in r["samples"])
    return f"""# The embedded default model

A {config.num_hidden_layers}-layer DeepSeek-V3 (MLA with q_lora, YaRN, {config.first_k_dense_replace} dense layer,
{config.n_routed_experts} routed experts in {config.n_group} groups (top-{config.topk_group} groups,
top-{config.num_experts_per_tok} experts) + {config.n_shared_experts} shared, one MTP module), trained on Python's
own documentation (`pydoc_data.topics` and the standard library's docstrings) with optax, shipped in DeepSeek's
FP8 format. Recipe: `jaxinfer/train/recipe.py`; reproduce with

```
nice -n 10 python scripts/train_tiny.py --out jaxinfer/default_model
```

(deterministic for the same Python {r['python']}, jax {r['jax']} and CPU).

| figure | value |
|---|---|
| held-out loss, shipped FP8 checkpoint | {r['heldout_loss']:.3f} nats/token |
| held-out loss, float32 before export | {r['heldout_loss_before_fp8']:.3f} nats/token |
| unigram baseline (train split, add-one) | {r['unigram_loss']:.3f} nats/token |
| top-1 accuracy, next token | {r['accuracy']:.3f} |
| MTP loss / top-1 accuracy, token after next | {r['mtp_loss']:.3f} / {r['mtp_accuracy']:.3f} |
| held-out tokens scored | {r['scored_tokens']} ({r['heldout_documents']} documents) |
| training tokens (train split) / seen | {r['train_tokens']} / {r['tokens_seen']} |
| steps x batch x length | {tc['steps']} x {tc['batch']} x {tc['seq_len']} |
| training wall time | {r['train_seconds']:.0f} s (whole pipeline {r['total_seconds']:.0f} s) |
| checkpoint size | {r['checkpoint_bytes'] / 2**20:.2f} MiB |
| config | vocab {config.vocab_size}, hidden {config.hidden_size}, {config.num_hidden_layers} layers + 1 MTP, \
{config.num_attention_heads} heads, q_lora {config.q_lora_rank}, kv_lora {config.kv_lora_rank}, nope/rope/v head dims \
{config.qk_nope_head_dim}/{config.qk_rope_head_dim}/{config.v_head_dim}, intermediate {config.intermediate_size}, \
moe_intermediate {config.moe_intermediate_size}, YaRN factor {config.rope.factor} over \
{config.rope.original_max_position_embeddings} positions (max {config.max_position_embeddings}) |

Optimizer: AdamW (b1 {tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), peak lr {tc['peak_lr']},
{tc['warmup_steps']} warmup steps, cosine to {tc['final_lr_fraction']} x peak, clip {tc['clip_norm']}; MTP weight
{tc['mtp_lambda']}; router bias update speed {tc['bias_gamma']}. Expert loads on the held-out split:
`expert_load.json`.

Greedy samples ({SAMPLE_TOKENS} tokens):

{samples}
"""
