"""google/flax's official examples as test cases: each model at small sizes, a batch of generated data, its loss.

The models are ported in `flax_example_nets` (mnist, imagenet, vae, ogbg_molpcba, nnx_toy_examples) and
`flax_example_seq` (lm1b, wmt, seq2seq, sst2), whose docstrings say where each comes from in google/flax.
An `ExampleCase` holds what a user passes to ``pj.trace``: ``fn(params, *inputs)`` with the params and the
inputs; the example's own loss ``loss(params, *inputs)`` (labels and other targets bound in, as its train.py
computes it, with the weight decay its loss has: imagenet's); which inputs are PRNG keys (dropout, noise,
sampling: the model runs in training mode, as its train step does); and the extra mutable state (BatchNorm's
statistics, bound into ``fn``, which returns them updated where the linen example asks for ``mutable``).
Params are float32, as the examples train. ``CASES`` maps a name to a function building the case (each
initialises its model with the model's own initialisers: a second or so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax_example_nets as nets
import flax_example_seq as seq
import jax
import jax.numpy as jnp
import jraph
import numpy as np
import optax
from flax import nnx

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ExampleCase:
    name: str
    source: str  # the google/flax file the model comes from
    fn: Callable[..., Any]  # fn(params, *inputs): what pj.trace reads
    params: Any
    inputs: tuple  # the positional arguments after params
    loss: Callable[..., Any]  # the example's loss, loss(params, *inputs) -> scalar
    rng_inputs: tuple[int, ...] = ()  # positions in ``inputs`` of PRNG keys (or nnx rng state)
    state: Any = None  # extra mutable state bound into fn (batch_stats), its initial value
    mutable: tuple[str, ...] = ()  # the collections fn returns updated, after its outputs
    sgd_lr: float = 0.05  # the example's learning rate where it trains with SGD (else the docs' 0.05)
    adam_lr: float = 1e-3  # the example's where it trains with Adam (else optax's usual 1e-3)
    data_loss: Callable[..., Any] | None = None  # the loss without its weight decay (which rescaling changes)
    one_example: bool = False  # DDP-SGD reads the whole batch as one example (a graph batch: no per-example axis)

    def batch_axes(self):
        """DDP-SGD's ``batch_axes``: the keys shared by every example, the rest batched (or all shared)."""
        if self.one_example:
            return None
        return tuple(None if i in self.rng_inputs else 0 for i in range(len(self.inputs)))


def _rng(seed=0):
    return np.random.default_rng(seed)


def _images(shape, seed=0):
    return jnp.asarray(_rng(seed).standard_normal(shape), F32)


def _ce(logits, labels):
    """mnist's and imagenet's cross-entropy: one-hot labels, ``optax.softmax_cross_entropy``, mean."""
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=jax.nn.one_hot(labels, logits.shape[-1])))


# ---------------------------------------------------------------------------- mnist


def mnist_linen() -> ExampleCase:
    model, x = nets.MnistCNN(features=(4, 8, 16)), _images((8, 8, 8, 1))
    labels = jnp.asarray(_rng(1).integers(0, 10, 8))
    params = model.init(jax.random.key(0), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    return ExampleCase("mnist_linen", "examples/mnist/train.py@0ef9abb2^", fn, params, (x,),
                       lambda p, x: _ce(fn(p, x), labels), sgd_lr=0.1)  # fmt: skip


def mnist_nnx() -> ExampleCase:
    model, x = nets.NnxMnistCNN((4, 8, 16), flat=32, rngs=nnx.Rngs(0)), _images((8, 8, 8, 1))
    labels = jnp.asarray(_rng(1).integers(0, 10, 8))
    graphdef, params = nnx.split(model, nnx.Param)
    fn = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
    loss = lambda p, x: optax.softmax_cross_entropy_with_integer_labels(fn(p, x), labels).mean()  # noqa: E731
    return ExampleCase("mnist_nnx", "examples/mnist/train.py (as nnx)", fn, params, (x,), loss, sgd_lr=0.1)


def mnist_nnx_bn() -> ExampleCase:
    """Training mode (``model.train()``): BatchNorm on the batch's statistics, dropout from the key input."""
    model, x = nets.NnxMnistBNCNN((4, 8, 16), flat=32, rngs=nnx.Rngs(0)), _images((8, 8, 8, 1))
    model.train()
    labels = jnp.asarray(_rng(1).integers(0, 10, 8))
    graphdef, params, stats = nnx.split(model, nnx.Param, ...)

    def fn(p, x, key):
        return nnx.merge(graphdef, p, stats, copy=True)(x, nnx.Rngs(key))

    loss = lambda p, x, k: optax.softmax_cross_entropy_with_integer_labels(fn(p, x, k), labels).mean()  # noqa: E731
    return ExampleCase("mnist_nnx_bn", "examples/mnist/train.py", fn, params, (x, jax.random.key(5)), loss,
                       rng_inputs=(1,), state=stats, sgd_lr=0.1)  # fmt: skip


# ---------------------------------------------------------------------------- imagenet


def _resnet(train: bool) -> ExampleCase:
    model, x = nets.ResNet(stage_sizes=(2, 2, 2, 2), num_classes=10, num_filters=4), _images((4, 32, 32, 3))
    labels = jnp.asarray(_rng(1).integers(0, 10, 4))
    variables = model.init(jax.random.key(0), x, train=False)
    params, stats = variables["params"], variables["batch_stats"]

    if train:  # train.py's apply: the batch's statistics, the running ones returned updated

        def fn(p, x):
            return model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])

    else:

        def fn(p, x):
            return model.apply({"params": p, "batch_stats": stats}, x, train=False)

    def data_loss(p, x):
        return _ce(fn(p, x)[0] if train else fn(p, x), labels)

    def loss(p, x):  # imagenet/train.py: cross-entropy + weight decay 1e-4 on every kernel
        weight_l2 = sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(p) if w.ndim > 1)
        return data_loss(p, x) + 0.0001 * 0.5 * weight_l2

    name = "resnet18_train" if train else "resnet18_eval"
    return ExampleCase(name, "examples/imagenet/models.py", fn, params, (x,), loss, state=stats, data_loss=data_loss,
                       mutable=("batch_stats",) if train else (), sgd_lr=0.1 * 128 / 256)  # fmt: skip


def resnet18_train() -> ExampleCase:
    return _resnet(True)


def resnet18_eval() -> ExampleCase:
    return _resnet(False)


# ---------------------------------------------------------------------------- lm1b, wmt


def weighted_cross_entropy(logits, targets, weights, label_smoothing=0.0):
    """lm1b's and wmt's ``compute_weighted_cross_entropy``, divided by the weights' sum (their ``loss_fn``)."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence) + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = jax.nn.one_hot(targets, vocab_size) * (confidence - low_confidence) + low_confidence
    loss = -jnp.sum(soft_targets * jax.nn.log_softmax(logits), axis=-1) - normalizing_constant
    return (loss * weights).sum() / weights.sum()


def _tokens(shape, vocab, seed):
    """Token ids in 2..vocab-1, each sequence padded with zeros after a random length (at least half)."""
    rng = _rng(seed)
    ids = rng.integers(2, vocab, shape)
    lengths = rng.integers(shape[1] // 2, shape[1] + 1, shape[0])
    return jnp.asarray(np.where(np.arange(shape[1]) < lengths[:, None], ids, 0), jnp.int32)


def _tiny_transformer(**kw) -> seq.TransformerConfig:
    return seq.TransformerConfig(vocab_size=12, output_vocab_size=12, emb_dim=8, num_heads=2, num_layers=2,
                                 qkv_dim=8, mlp_dim=16, max_len=16, deterministic=False, **kw)  # fmt: skip


def lm1b() -> ExampleCase:
    """lm1b/train.py: the tokens are the targets (the decoder shifts them right), padding weighed 0; dropout on."""
    model, ids = seq.TransformerLM(_tiny_transformer()), _tokens((4, 8), 12, 2)
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, ids)["params"]
    fn = lambda p, ids, key: model.apply({"params": p}, ids, rngs={"dropout": key})  # noqa: E731

    def loss(p, ids, key):
        return weighted_cross_entropy(fn(p, ids, key), ids, (ids > 0).astype(F32))

    return ExampleCase("lm1b", "examples/lm1b/models.py", fn, params, (ids, jax.random.key(3)), loss,
                       rng_inputs=(1,), adam_lr=0.0016)  # fmt: skip


def wmt() -> ExampleCase:
    """wmt's default config: shared embeddings, logits through the embedding, label smoothing 0.1; dropout on."""
    model = seq.Transformer(_tiny_transformer(share_embeddings=True, logits_via_embedding=True))
    inputs, targets = _tokens((4, 7), 12, 2), _tokens((4, 6), 12, 3)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    params = model.init(rngs, inputs, targets)["params"]
    fn = lambda p, i, t, key: model.apply({"params": p}, i, t, rngs={"dropout": key})  # noqa: E731

    def loss(p, i, t, key):
        return weighted_cross_entropy(fn(p, i, t, key), t, (t > 0).astype(F32), label_smoothing=0.1)

    return ExampleCase("wmt", "examples/wmt/models.py", fn, params, (inputs, targets, jax.random.key(3)), loss,
                       rng_inputs=(2,), adam_lr=0.002)  # fmt: skip


# ---------------------------------------------------------------------------- seq2seq, sst2


def _one_hot_sequences(lengths, max_len, vocab, eos_id, first=None, seed=0):
    """One-hot sequences of random tokens (ids ≥ 2), EOS after ``lengths`` tokens, padding (id 0) after it."""
    rng = _rng(seed)
    ids = rng.integers(2, vocab, (len(lengths), max_len))
    if first is not None:
        ids[:, 0] = first
    pos = np.arange(max_len)
    ids = np.where(pos < lengths[:, None], ids, np.where(pos == lengths[:, None], eos_id, 0))
    return jnp.asarray(jax.nn.one_hot(ids, vocab), F32)


def seq2seq() -> ExampleCase:
    """seq2seq/train.py: no teacher forcing (the decoder feeds back its samples, drawn with the ``'lstm'`` key);
    cross-entropy over the answer after its first token, masked beyond each answer's EOS."""
    vocab, eos = 6, 1
    model = seq.Seq2seq(teacher_force=False, hidden_size=8, vocab_size=vocab, eos_id=eos)
    query = _one_hot_sequences(np.array([3, 4, 2, 3]), 5, vocab, eos, seed=4)
    answer = _one_hot_sequences(np.array([3, 2, 3, 1]), 4, vocab, eos, first=2, seed=5)  # "=" is id 2 here
    rngs = {"params": jax.random.key(0), "lstm": jax.random.key(1)}
    params = model.init(rngs, query, answer)["params"]
    fn = lambda p, q, a, key: model.apply({"params": p}, q, a, rngs={"lstm": key})  # noqa: E731
    labels = answer[:, 1:]
    eos_row = labels[:, :, eos]
    eos_idx = jnp.argmax(eos_row, axis=-1)
    lengths = jnp.where(eos_row[jnp.arange(eos_row.shape[0]), eos_idx], eos_idx + 1, labels.shape[1])

    def loss(p, q, a, key):  # cross_entropy_loss with get_sequence_lengths and mask_sequences
        xe = jnp.sum(jax.nn.log_softmax(fn(p, q, a, key)[0]) * labels, axis=-1)
        return -jnp.mean(xe * (lengths[:, None] > jnp.arange(xe.shape[1])[None]))

    return ExampleCase("seq2seq", "examples/seq2seq/models.py", fn, params, (query, answer, jax.random.key(3)),
                       loss, rng_inputs=(2,), adam_lr=0.003)  # fmt: skip


def sst2() -> ExampleCase:
    """sst2/train.py: dropout 0.5 and word dropout 0.1 on, sigmoid cross-entropy of one logit (its weight decay is
    in the optimiser, ``optax.add_decayed_weights``, not in the loss)."""
    model = seq.TextClassifier(embedding_size=6, hidden_size=5, vocab_size=12, output_size=1, dropout_rate=0.5,
                               word_dropout_rate=0.1, unk_idx=1)  # fmt: skip
    lengths = jnp.asarray([6, 4, 5, 3], jnp.int32)
    token_ids = jnp.where(jnp.arange(6) < lengths[:, None], _tokens((4, 6), 12, 6).clip(2), 0)
    labels = jnp.asarray([[1.0], [0.0], [1.0], [0.0]], F32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    params = model.init(rngs, token_ids, lengths, deterministic=False)["params"]
    fn = lambda p, t, n, key: model.apply({"params": p}, t, n, deterministic=False, rngs={"dropout": key})  # noqa: E731

    def loss(p, t, n, key):  # sigmoid_cross_entropy_with_logits, as train.py writes it
        logits = fn(p, t, n, key)
        relu_logits = jnp.where(logits >= 0, logits, 0)
        neg_abs_logits = jnp.where(logits >= 0, -logits, logits)
        return jnp.mean(relu_logits - logits * labels + jnp.log1p(jnp.exp(neg_abs_logits)))

    return ExampleCase("sst2", "examples/sst2/models.py", fn, params, (token_ids, lengths, jax.random.key(3)),
                       loss, rng_inputs=(2,), sgd_lr=0.1)  # fmt: skip


# ---------------------------------------------------------------------------- vae


def _binary_images(shape, seed):
    return jnp.asarray(_rng(seed).random(shape) > 0.6, F32)


def vae() -> ExampleCase:
    """vae/train.py: binary cross-entropy of the reconstruction plus the KL term, each summed per example and
    averaged; the noise from the ``z_rng`` input."""
    model, x = nets.VAE(latents=3, hidden=16, pixels=49), _binary_images((8, 49), 7)
    params = model.init({"params": jax.random.key(0)}, x, jax.random.key(1))["params"]
    fn = lambda p, x, z_rng: model.apply({"params": p}, x, z_rng)  # noqa: E731

    def loss(p, x, z_rng):
        recon_x, mean, logvar = fn(p, x, z_rng)
        log_p = jax.nn.log_sigmoid(recon_x)
        bce = -jnp.sum(x * log_p + (1.0 - x) * jnp.log(-jnp.expm1(log_p)), axis=-1)
        kld = -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), axis=-1)
        return bce.mean() + kld.mean()

    return ExampleCase("vae", "examples/vae/models.py", fn, params, (x, jax.random.key(3)), loss, rng_inputs=(1,))


def vae_nnx() -> ExampleCase:
    """05_vae.py: the model's own ``noise`` stream (its rng state, an input here: it advances in training),
    loss: mean sigmoid binary cross-entropy plus 0.1 times the KL term the encoder stored (fn returns both)."""
    model, x = nets.NnxVAE(49, 16, 4, (7, 7), rngs=nnx.Rngs(0, noise=1)), _binary_images((8, 7, 7), 7)
    graphdef, params, rng_state = nnx.split(model, nnx.Param, nnx.RngState)

    def fn(p, x, rng_state):
        model = nnx.merge(graphdef, p, rng_state, copy=True)
        logits = model(x)
        return logits, sum(jax.tree_util.tree_leaves(nnx.pop(model, nets.Loss)), 0.0)

    def loss(p, x, rng_state):
        logits, kl_loss = fn(p, x, rng_state)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x)) + 0.1 * kl_loss

    return ExampleCase("vae_nnx", "examples/nnx_toy_examples/05_vae.py", fn, params, (x, rng_state), loss,
                       rng_inputs=(1,))  # fmt: skip


# ---------------------------------------------------------------------------- ogbg_molpcba


def molecules(n_nodes=(3, 4, 2), node_features=9, edge_features=3, num_classes=4, seed=8):
    """(graphs, labels): a chain molecule per graph with undirected edges (both directions, as the input pipeline
    adds them), padded with one dummy graph as ``jraph.pad_with_graphs`` does; globals are ones
    (``replace_globals``); labels with a missing entry (NaN) per real graph, and NaN for the dummy graph."""
    rng, offset, senders, receivers = _rng(seed), 0, [], []
    for n in n_nodes:
        for i in range(n - 1):
            senders += [offset + i, offset + i + 1]
            receivers += [offset + i + 1, offset + i]
        offset += n
    graphs = jraph.GraphsTuple(
        nodes=jnp.asarray(rng.standard_normal((offset, node_features)), F32),
        edges=jnp.asarray(rng.standard_normal((len(senders), edge_features)), F32),
        senders=jnp.asarray(senders, jnp.int32), receivers=jnp.asarray(receivers, jnp.int32),
        n_node=jnp.asarray(n_nodes, jnp.int32), n_edge=jnp.asarray([2 * (n - 1) for n in n_nodes], jnp.int32),
        globals=None,
    )  # fmt: skip
    graphs = jraph.pad_with_graphs(graphs, n_node=offset + 1, n_edge=len(senders) + 2, n_graph=len(n_nodes) + 1)
    graphs = graphs._replace(globals=jnp.ones((len(n_nodes) + 1, 1), F32))
    labels = (rng.random((len(n_nodes) + 1, num_classes)) > 0.5).astype(np.float32)
    labels[np.arange(len(n_nodes)), rng.integers(0, num_classes, len(n_nodes))] = np.nan
    labels[-1] = np.nan
    return graphs, jnp.asarray(labels)


def ogbg_molpcba() -> ExampleCase:
    """ogbg_molpcba/train.py: the GraphConvNet's logits are its output globals; binary cross-entropy over the
    labels present and the real graphs, dropout 0.1 on."""
    model = nets.GraphConvNet(latent_size=8, num_mlp_layers=2, message_passing_steps=2, output_globals_size=4,
                              dropout_rate=0.1, deterministic=False)  # fmt: skip
    graphs, labels = molecules()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, graphs)["params"]
    fn = lambda p, g, key: model.apply({"params": p}, g, rngs={"dropout": key}).globals  # noqa: E731

    def loss(p, g, key):  # binary_cross_entropy_with_mask, get_valid_mask
        mask = ~jnp.isnan(labels) & jraph.get_graph_padding_mask(g)[:, None]
        logits, y = fn(p, g, key), jnp.where(mask, labels, -1)
        per = jnp.where(logits >= 0, logits, 0) - logits * y + jnp.log(1 + jnp.exp(-jnp.abs(logits)))
        return jnp.sum(jnp.where(mask, per, 0)) / jnp.sum(mask)

    return ExampleCase("ogbg_molpcba", "examples/ogbg_molpcba/models.py", fn, params, (graphs, jax.random.key(3)),
                       loss, rng_inputs=(1,), one_example=True)  # fmt: skip


# ---------------------------------------------------------------------------- nnx scan over layers


def scan_over_layers() -> ExampleCase:
    """06_scan_over_layers.py (dim 6, 3 layers; BatchNorm in training mode, as nnx builds it); each block's
    dropout stream is part of the rng state input. The example has no loss: mean squared error to a target."""
    model, x = nets.ScanMLP(6, n_layers=3, rngs=nnx.Rngs(0)), _images((8, 6), 9)
    y = _images((8, 6), 10)
    graphdef, params, rng_state, stats = nnx.split(model, nnx.Param, nnx.RngState, ...)
    fn = lambda p, x, r: nnx.merge(graphdef, p, r, stats, copy=True)(x)  # noqa: E731
    loss = lambda p, x, r: jnp.mean((fn(p, x, r) - y) ** 2)  # noqa: E731
    return ExampleCase("scan_over_layers", "examples/nnx_toy_examples/06_scan_over_layers.py", fn, params,
                       (x, rng_state), loss, rng_inputs=(1,), state=stats)  # fmt: skip


CASES: dict[str, Callable[[], ExampleCase]] = {
    f.__name__: f
    for f in (mnist_linen, mnist_nnx, mnist_nnx_bn, resnet18_train, resnet18_eval, lm1b, wmt, seq2seq, sst2, vae,
              vae_nnx, ogbg_molpcba, scan_over_layers)
}  # fmt: skip
