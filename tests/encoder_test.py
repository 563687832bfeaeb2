"""The Flax encoder against the reference implementation in transformers, on random checkpoints that
transformers itself wrote (no download): BERT with absolute positions and RoFormer with rotary ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import write_tiny_checkpoint

from docbeam import attention
from docbeam.models import checkpoint, encoder


def reference_hidden(folder: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(folder).eval()
    mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.last_hidden_state.numpy()


def ours_hidden(folder: str, ids, lengths, backend: str = "native", use_jit: bool = True, dtype="float32"):
    ck = checkpoint.open_checkpoint(folder, dtype)
    params = checkpoint.load_params(ck.folder, ck.config)
    module = encoder.Encoder(ck.config, attention.get(backend).bind())
    apply = lambda p, i, n: module.apply({"params": p}, i, n)  # noqa: E731
    return np.asarray((jax.jit(apply) if use_jit else apply)(params, ids, lengths), np.float32)


def inputs(batch: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 3, seq + 1, batch).astype(np.int32)
    lengths[0] = seq
    ids = rng.integers(1000, 30000, (batch, seq)).astype(np.int32)
    ids[np.arange(seq)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def valid_rows(x, lengths):
    return x[np.arange(x.shape[1])[None, :] < lengths[:, None]]


@pytest.mark.parametrize("use_jit", [True, False])
def test_bert_matches_transformers(tiny_checkpoint_dir, use_jit):
    ids, lengths = inputs(3, 40)
    ours = ours_hidden(tiny_checkpoint_dir, ids, lengths, use_jit=use_jit)
    assert ours.shape == (3, 40, 32) and np.isfinite(ours).all()
    np.testing.assert_allclose(
        valid_rows(ours, lengths), valid_rows(reference_hidden(tiny_checkpoint_dir, ids, lengths), lengths), atol=2e-5
    )


@pytest.fixture(scope="module")
def tiny_roformer_dir(tmp_path_factory, real_checkpoint_dir):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-roformer")), real_checkpoint_dir, rope=True)


@pytest.mark.parametrize("backend", ["native", "chunked"])
def test_rotary_encoder_matches_transformers_roformer_beyond_512_tokens(tiny_roformer_dir, backend):
    assert checkpoint.open_checkpoint(tiny_roformer_dir).config.position == "rope"
    ids, lengths = inputs(2, 500)  # RoFormer's own table stops at max_position_embeddings (512 here)
    ours = ours_hidden(tiny_roformer_dir, ids, lengths, backend=backend)
    np.testing.assert_allclose(
        valid_rows(ours, lengths), valid_rows(reference_hidden(tiny_roformer_dir, ids, lengths), lengths), atol=5e-5
    )
    long_ids, long_lengths = inputs(1, 2048)
    assert np.isfinite(ours_hidden(tiny_roformer_dir, long_ids, long_lengths, backend=backend)).all()


def test_bfloat16_stays_close_to_float32(tiny_checkpoint_dir):
    ids, lengths = inputs(2, 32)
    f32 = ours_hidden(tiny_checkpoint_dir, ids, lengths)
    bf16 = ours_hidden(tiny_checkpoint_dir, ids, lengths, dtype="bfloat16")
    assert np.abs(valid_rows(f32, lengths) - valid_rows(bf16, lengths)).max() < 0.1


def test_pickle_checkpoints_are_refused(tmp_path, tiny_checkpoint_dir):
    import shutil

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_checkpoint_dir, folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    ck = checkpoint.open_checkpoint(str(folder))
    with pytest.raises(checkpoint.CheckpointError, match="pickle checkpoint.*arbitrary code"):
        checkpoint.load_params(ck.folder, ck.config)


def test_sentence_transformers_settings_decide_window_pooling_and_normalisation(real_checkpoint_dir):
    settings = checkpoint.open_checkpoint(real_checkpoint_dir).settings
    assert settings == checkpoint.ModelSettings(max_seq_len=256, pooling="mean", normalize=True)


def test_unknown_architectures_are_refused_with_the_supported_list(tmp_path, tiny_checkpoint_dir):
    import json
    import shutil

    folder = tmp_path / "gpt"
    shutil.copytree(tiny_checkpoint_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(checkpoint.CheckpointError, match="'gpt2'.*supported: bert"):
        checkpoint.open_checkpoint(str(folder))


def test_bert_gelu_is_the_exact_erf_form_over_the_whole_float32_range():
    """The clipped-argument GELU (faster on XLA:CPU) against the erf form computed in float64."""
    import math

    x = np.concatenate([np.linspace(-12, 12, 20001), [-1e4, -80.0, -6.0, 6.0, 80.0, 1e4, 0.0]]).astype(np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    got = np.asarray(jax.jit(encoder.ACTIVATIONS["gelu"])(x), np.float64)
    assert np.all(np.abs(got - want) <= 2e-6 * np.maximum(1.0, np.abs(want)))


def test_lasttoken_pools_each_windows_last_valid_token_right_padded_and_packed():
    hidden_BxTxD = np.arange(2 * 6, dtype=np.float32).reshape(2, 6, 1) + 100  # token t of row b: 100 + 6b + t
    rows = encoder.pool(hidden_BxTxD, np.array([4, 6], np.int32), "lasttoken")
    assert rows[:, 0].tolist() == [103.0, 111.0]
    segments_BxT = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    slots = encoder.pool_segments(hidden_BxTxD, segments_BxT, np.array([[2, 3], [6, 0]], np.int32), "lasttoken")
    assert slots[..., 0].tolist() == [[101.0, 104.0], [111.0, 0.0]]  # an empty slot stays zero
