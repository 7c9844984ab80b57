"""google/flax's official examples, sequence models, ported layer for layer at small sizes.

The cases (sizes, data, losses) are in `flax_examples`. Where each comes from, in google/flax:

* `TransformerConfig`, `TransformerLM`: examples/lm1b/models.py; `Transformer` (encoder-decoder):
  examples/wmt/models.py, whose decoder lm1b reuses. Autoregressive decoding (``decode=True``, the cache) and
  packed examples (positions, segmentation) are left out, and so is ``nn.with_logical_partitioning`` (metadata).
* `Seq2seq`, `DecoderLSTMCell`: examples/seq2seq/models.py.
* `TextClassifier` and its parts: examples/sst2/models.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

# ---------------------------------------------------------------------------- lm1b and wmt


@struct.dataclass
class TransformerConfig:
    """Global hyperparameters (examples/lm1b/models.py, examples/wmt/models.py)."""

    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
    """Shift the input to the right by padding and slicing on axis."""
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    """1D sinusoidal position embedding initializer: ``(1, max_len, d_feature)``."""

    def init(key, shape, dtype=np.float32):
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
        return jnp.array(pe[np.newaxis, :, :])

    return init


class AddPositionEmbs(nn.Module):
    """Adds the fixed sinusoidal position embeddings (the examples' default, ``posemb_init=None``)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        assert inputs.ndim == 3
        pos_embedding = sinusoidal_init(max_len=self.config.max_len)(None, (1, self.config.max_len, inputs.shape[-1]))
        return inputs + pos_embedding[:, : inputs.shape[1], :]


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block: Dense, ReLU, dropout, Dense, dropout."""

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype, kernel_init=cfg.kernel_init, bias_init=cfg.bias_init)(inputs)
        x = nn.Dropout(rate=cfg.dropout_rate)(nn.relu(x), deterministic=cfg.deterministic)
        out = nn.Dense(out_dim, dtype=cfg.dtype, kernel_init=cfg.kernel_init, bias_init=cfg.bias_init)(x)
        return nn.Dropout(rate=cfg.dropout_rate)(out, deterministic=cfg.deterministic)


def _attention(cfg: TransformerConfig):
    return nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, dtype=cfg.dtype, qkv_features=cfg.qkv_dim, kernel_init=cfg.kernel_init,
        bias_init=cfg.bias_init, use_bias=False, broadcast_dropout=False,
        dropout_rate=cfg.attention_dropout_rate, deterministic=cfg.deterministic,
    )  # fmt: skip


class Encoder1DBlock(nn.Module):
    """wmt's encoder layer: pre-LayerNorm self-attention and MLP, both residual."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, encoder_mask=None):
        cfg = self.config
        x = _attention(cfg)(nn.LayerNorm(dtype=cfg.dtype)(inputs), mask=encoder_mask)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic) + inputs
        return x + MlpBlock(config=cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


class EncoderDecoder1DBlock(nn.Module):
    """The decoder layer: masked self-attention, then (wmt, ``encoded`` given) attention to the encoder's output,
    then the MLP; lm1b's layer has no encoder-decoder attention."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, targets, encoded=None, decoder_mask=None, encoder_decoder_mask=None):
        cfg = self.config
        x = _attention(cfg)(nn.LayerNorm(dtype=cfg.dtype)(targets), mask=decoder_mask)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic) + targets
        if encoded is not None:
            y = _attention(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x), encoded, mask=encoder_decoder_mask)
            x = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic) + x
        return x + MlpBlock(config=cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


def _embed(cfg, num_embeddings):
    return nn.Embed(num_embeddings, cfg.emb_dim, embedding_init=nn.initializers.normal(stddev=1.0))


class Encoder(nn.Module):
    """wmt's encoder: embedding, sinusoidal positions, dropout, encoder layers, LayerNorm."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, encoder_mask=None):
        cfg = self.config
        embed = _embed(cfg, cfg.vocab_size) if self.shared_embedding is None else self.shared_embedding
        x = AddPositionEmbs(config=cfg, name="posembed_input")(embed(inputs.astype("int32")))
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic).astype(cfg.dtype)
        for lyr in range(cfg.num_layers):
            x = Encoder1DBlock(config=cfg, name=f"encoderblock_{lyr}")(x, encoder_mask)
        return nn.LayerNorm(dtype=cfg.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
    """The decoder: targets shifted right, embedded, with positions; decoder layers, LayerNorm, logits (a Dense, or
    the embedding's transpose over √emb_dim when ``logits_via_embedding``)."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, encoded, targets, decoder_mask=None, encoder_decoder_mask=None):
        cfg = self.config
        embed = _embed(cfg, cfg.output_vocab_size) if self.shared_embedding is None else self.shared_embedding
        y = embed(shift_right(targets.astype("int32")))
        y = AddPositionEmbs(config=cfg, name="posembed_output")(y)
        y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic).astype(cfg.dtype)
        for lyr in range(cfg.num_layers):
            y = EncoderDecoder1DBlock(config=cfg, name=f"encoderdecoderblock_{lyr}")(
                y, encoded, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask
            )
        y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
        if cfg.logits_via_embedding:
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        dense = nn.Dense(cfg.output_vocab_size, dtype=cfg.dtype, kernel_init=cfg.kernel_init,
                         bias_init=cfg.bias_init, name="logitdense")  # fmt: skip
        return dense(y)


class TransformerLM(nn.Module):
    """examples/lm1b/models.py: the decoder alone, causal and padding masks (token 0 is padding)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=cfg.dtype),
            nn.make_causal_mask(inputs, dtype=cfg.dtype),
        )
        logits = Decoder(config=cfg, name="decoder")(None, inputs, decoder_mask=decoder_mask)
        return logits.astype(cfg.dtype)


class Transformer(nn.Module):
    """examples/wmt/models.py: encoder and decoder, the embedding shared when ``share_embeddings``."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.shared_embedding = _embed(cfg, cfg.vocab_size) if cfg.share_embeddings else None
        self.encoder = Encoder(config=cfg, shared_embedding=self.shared_embedding)
        self.decoder = Decoder(config=cfg, shared_embedding=self.shared_embedding)

    def __call__(self, inputs, targets):
        cfg = self.config
        encoded = self.encoder(inputs, encoder_mask=nn.make_attention_mask(inputs > 0, inputs > 0, dtype=cfg.dtype))
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0, dtype=cfg.dtype),
            nn.make_causal_mask(targets, dtype=cfg.dtype),
        )
        encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=cfg.dtype)
        logits = self.decoder(encoded, targets, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask)
        return logits.astype(cfg.dtype)


# ---------------------------------------------------------------------------- seq2seq


class DecoderLSTMCell(nn.RNNCellBase):
    """An LSTM step whose input, without teacher forcing, is its own last prediction: a token sampled from its
    logits with the ``'lstm'`` rng, one-hot."""

    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        predicted_token = jax.random.categorical(self.make_rng("lstm"), logits)
        prediction = jax.nn.one_hot(predicted_token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    """An LSTM encoder (read up to each query's EOS) and a `DecoderLSTMCell` decoder started from its state."""

    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(
            DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force, self.vocab_size),
            split_rngs={"params": False, "lstm": True},
            name="decoder",
        )
        seq_lengths = jnp.argmax(jnp.argmax(encoder_inputs, axis=-1) == self.eos_id, axis=-1)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        return decoder(decoder_inputs[:, :-1], initial_carry=(encoder_state, decoder_inputs[:, 0]))


# ---------------------------------------------------------------------------- sst2


def sequence_mask(lengths, max_length: int):
    """<bool>[batch, max_length]: which positions are within each sequence's length."""
    return jnp.arange(max_length)[None] < lengths[:, None]


@jax.vmap
def flip_sequences(inputs, lengths):
    """Flips each sequence within its length, the padding kept at the end."""
    return jnp.flip(jnp.roll(inputs, inputs.shape[0] - lengths, axis=0), axis=0)


class WordDropout(nn.Module):
    """Replaces each input id by ``unk_idx`` with probability ``dropout_rate``."""

    dropout_rate: float
    unk_idx: int

    @nn.compact
    def __call__(self, inputs, deterministic: bool):
        if deterministic or self.dropout_rate == 0.0:
            return inputs
        mask = jax.random.bernoulli(self.make_rng("dropout"), p=self.dropout_rate, shape=inputs.shape)
        return jnp.where(mask, jnp.array([self.unk_idx]), inputs)


class Embedder(nn.Module):
    """Word dropout, an embedding table (normal, stddev 0.1), dropout."""

    vocab_size: int
    embedding_size: int
    dropout_rate: float = 0.0
    word_dropout_rate: float = 0.0
    unk_idx: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs, deterministic: bool):
        shape = (self.vocab_size, self.embedding_size)
        table = self.param("embedding", nn.initializers.normal(stddev=0.1), shape, self.dtype)
        inputs = WordDropout(self.word_dropout_rate, self.unk_idx, name="word_dropout_layer")(inputs, deterministic)
        return nn.Dropout(rate=self.dropout_rate, name="dropout_layer")(table[inputs], deterministic=deterministic)


class SimpleLSTM(nn.Module):
    """A unidirectional ``nn.OptimizedLSTMCell``, scanned over positions."""

    hidden_size: int

    @functools.partial(
        nn.transforms.scan, variable_broadcast="params", in_axes=1, out_axes=1, split_rngs={"params": False}
    )
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

    def initialize_carry(self, input_shape):
        return nn.OptimizedLSTMCell(self.hidden_size, parent=None).initialize_carry(jax.random.key(0), input_shape)


class SimpleBiLSTM(nn.Module):
    """Forward and backward (each sequence flipped within its length) LSTMs, concatenated."""

    hidden_size: int

    @nn.compact
    def __call__(self, embedded_inputs, lengths):
        forward, backward = (
            SimpleLSTM(self.hidden_size, name="forward_lstm"),
            SimpleLSTM(self.hidden_size, name="backward_lstm"),
        )
        _, forward_outputs = forward(forward.initialize_carry(embedded_inputs[:, 0].shape), embedded_inputs)
        reversed_inputs = flip_sequences(embedded_inputs, lengths)
        _, backward_outputs = backward(backward.initialize_carry(reversed_inputs[:, 0].shape), reversed_inputs)
        return jnp.concatenate([forward_outputs, flip_sequences(backward_outputs, lengths)], -1)


class MLP(nn.Module):
    """Dense, tanh, dropout, Dense without bias."""

    hidden_size: int
    output_size: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, inputs, deterministic: bool):
        hidden = nn.tanh(nn.Dense(self.hidden_size, name="intermediate_layer")(inputs))
        hidden = nn.Dropout(rate=self.dropout_rate, name="dropout_layer")(hidden, deterministic=deterministic)
        return nn.Dense(self.output_size, use_bias=False, name="output_layer")(hidden)


class KeysOnlyMlpAttention(nn.Module):
    """Bahdanau attention from the keys alone: tanh MLP scores, masked softmax over positions."""

    hidden_size: int

    @nn.compact
    def __call__(self, keys, mask):
        energy = nn.tanh(nn.Dense(self.hidden_size, name="keys", use_bias=False)(keys))
        scores = nn.Dense(1, name="energy", use_bias=False)(energy).squeeze(-1)
        scores = nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        self.sow("intermediates", "attention", scores)
        return scores


class AttentionClassifier(nn.Module):
    """Dropout, attention pooling of the encoded inputs, dropout, `MLP`."""

    hidden_size: int
    output_size: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, encoded_inputs, lengths, deterministic: bool):
        dropout = nn.Dropout(rate=self.dropout_rate, name="dropout_layer")
        encoded_inputs = dropout(encoded_inputs, deterministic=deterministic)
        mask = sequence_mask(lengths, encoded_inputs.shape[1])
        attention = KeysOnlyMlpAttention(self.hidden_size, name="keys_only_mlp_attention")(encoded_inputs, mask)
        context = (jnp.expand_dims(attention, 1) @ encoded_inputs).squeeze(1)
        context = dropout(context, deterministic=deterministic)
        return MLP(self.hidden_size, self.output_size, self.dropout_rate, name="mlp")(context, deterministic)


class TextClassifier(nn.Module):
    """sst2's model: `Embedder`, `SimpleBiLSTM`, `AttentionClassifier`."""

    embedding_size: int
    hidden_size: int
    vocab_size: int
    output_size: int
    dropout_rate: float
    word_dropout_rate: float
    unk_idx: int = 1

    @nn.compact
    def __call__(self, token_ids, lengths, deterministic: bool):
        embedded = Embedder(self.vocab_size, self.embedding_size, self.dropout_rate, self.word_dropout_rate,
                            self.unk_idx, name="embedder")(token_ids, deterministic)  # fmt: skip
        encoded = SimpleBiLSTM(self.hidden_size, name="encoder")(embedded, lengths)
        classifier = AttentionClassifier(self.hidden_size, self.output_size, self.dropout_rate, name="classifier")
        return classifier(encoded, lengths, deterministic)
