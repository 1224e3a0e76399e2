"""Malformed configs, checkpoints and token ids are rejected with errors that name the problem.

Config problems -> ValueError naming the field; tensor problems -> jaxinfer.checkpoint.CheckpointError (a
ValueError) listing every offending tensor name in one error; truncated safetensors -> CheckpointError; token
ids outside [0, vocab) or not an int [B, T] array -> ValueError. Unknown extra config fields warn and load.
Every case edits a copy of a valid tiny checkpoint (v3_noqlora_default, one safetensors file).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import hf_oracle as O

BASE = "v3_noqlora_default"


@pytest.fixture
def ckpt(tmp_path, tmp_path_factory):
    """A fresh, editable copy of the valid base checkpoint."""
    return O.copy_checkpoint(O.build_case(BASE, tmp_path_factory).path, tmp_path / "ckpt")


def _load(path, dtype="float32"):
    import jaxinfer

    return jaxinfer.load_model(str(path), mesh="1x1", dtype=dtype)


def _edit_config(path, **changes):
    cfg = O.read_config(path)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    O.write_config(path, cfg)


def _edit_tensors(path, edit):
    tensors = O.read_tensors(path)
    edit(tensors)
    O.write_tensors(path, tensors)


def _checkpoint_error():
    from jaxinfer.checkpoint import CheckpointError

    assert issubclass(CheckpointError, ValueError)
    return CheckpointError


# ---- config.json ------------------------------------------------------------------------------------------------


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64,,}')
    with pytest.raises(ValueError, match="(?i)json"):
        _load(ckpt)


def test_config_missing(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        _load(ckpt)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_group": 3}, "n_group|n_routed_experts"),  # 8 experts in 3 groups
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # more than the 8 experts
        ({"model_type": "llama"}, "model_type"),
    ],
    ids=["scoring_func", "n_group", "longrope", "kv_heads", "negative_hidden", "top_k", "model_type"],
)
def test_bad_config_value_names_the_field(ckpt, changes, field):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=field) as err:
        _load(ckpt)
    print(f"\n{field}: {err.value}")


@pytest.mark.filterwarnings("ignore:config field .rope_parameters")
def test_legacy_longrope_names_the_field(ckpt):
    _edit_config(ckpt, rope_parameters=None, rope_theta=10000.0,
                 rope_scaling={"type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [1.0]})
    with pytest.raises(ValueError, match="rope_type|rope_scaling"):
        _load(ckpt)


def test_unknown_config_field_warns_and_loads(ckpt):
    _edit_config(ckpt, my_custom_field=123)
    with pytest.warns(UserWarning, match="my_custom_field"):
        model = _load(ckpt)
    assert model.config.vocab_size == O.CONFIGS[BASE]["vocab_size"]


def test_plain_transformers_config_loads_without_field_warnings(tmp_path_factory):
    """The config.json transformers writes (head_dim, qk_head_dim, dtype, output_router_logits, ...) carries no
    field jaxinfer should warn about."""
    path = O.build_case(BASE, tmp_path_factory).path
    keys = set(O.read_config(path))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _load(path)
    noisy = [str(w.message) for w in rec if any(f"'{k}'" in str(w.message) for k in keys)]
    assert not noisy, noisy


# ---- tensors ----------------------------------------------------------------------------------------------------

MISSING = "model.layers.1.self_attn.o_proj.weight"
EXTRA = "model.layers.0.self_attn.extra_proj.weight"
RESHAPED = "model.layers.0.self_attn.kv_b_proj.weight"
RETYPED = "model.layers.0.mlp.experts.3.up_proj.weight"


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(MISSING))
    with pytest.raises(_checkpoint_error(), match=MISSING.replace(".", r"\.")):
        _load(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__(EXTRA, torch.zeros(4, 4)))
    with pytest.raises(_checkpoint_error(), match=EXTRA.replace(".", r"\.")):
        _load(ckpt)


def test_wrong_shape_tensor(ckpt):
    def edit(t):
        w = t[RESHAPED]
        t[RESHAPED] = torch.zeros(w.shape[0], w.shape[1] + 1)

    _edit_tensors(ckpt, edit)
    with pytest.raises(_checkpoint_error(), match=RESHAPED.replace(".", r"\.")):
        _load(ckpt)


def test_wrong_dtype_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__(RETYPED, t[RETYPED].to(torch.int32)))
    with pytest.raises(_checkpoint_error(), match=RETYPED.replace(".", r"\.")):
        _load(ckpt)


def test_all_problems_listed_in_one_error(ckpt):
    def edit(t):
        t.pop(MISSING)
        t[EXTRA] = torch.zeros(4, 4)
        w = t[RESHAPED]
        t[RESHAPED] = torch.zeros(w.shape[0] + 2, w.shape[1])
        t[RETYPED] = t[RETYPED].to(torch.int32)

    _edit_tensors(ckpt, edit)
    with pytest.raises(_checkpoint_error()) as err:
        _load(ckpt)
    msg = str(err.value)
    print(f"\n{msg}")
    for name in (MISSING, EXTRA, RESHAPED, RETYPED):
        assert name in msg, f"{name} not listed in: {msg}"


@pytest.mark.parametrize("keep", ["most", "header_only", "eight_bytes"])
def test_truncated_safetensors(ckpt, keep):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    cut = {"most": len(data) - 100, "header_only": header_end, "eight_bytes": 8}[keep]
    f.write_bytes(data[:cut])
    with pytest.raises(_checkpoint_error(), match="model.safetensors"):
        _load(ckpt)


def test_index_names_a_missing_file(ckpt):
    """An index whose weight_map points to a shard that is not there."""
    names = list(O.read_tensors(ckpt))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[MISSING] = "model-00002-of-00002.safetensors"
    (ckpt / O.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(_checkpoint_error(), match="model-00002-of-00002"):
        _load(ckpt)


# ---- token ids --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_ids",
    [
        lambda v: np.full((2, 5), v, np.int32),  # id == vocab
        lambda v: np.array([[0, 1, -1]], np.int32),  # negative
        lambda v: np.zeros((2, 5), np.float32),  # float
        lambda v: np.zeros((5,), np.int32),  # 1-D
        lambda v: np.zeros((1, 2, 5), np.int32),  # 3-D
        lambda v: np.array([[0, 1, 2**40]], np.int64),  # far out of range (no silent int32 wrap-around)
    ],
    ids=["id_eq_vocab", "negative", "float", "1d", "3d", "huge_int64"],
)
def test_bad_token_ids(make_ids, tmp_path_factory):
    model = O.load_jax_model(O.build_case(BASE, tmp_path_factory).path, "float32")
    with pytest.raises(ValueError):
        model.logits(make_ids(O.CONFIGS[BASE]["vocab_size"]))
