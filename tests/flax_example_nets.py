"""google/flax's official examples, image and graph models, ported layer for layer at small sizes.

The cases (sizes, data, losses) are in `flax_examples`; the sequence models in `flax_example_seq`. Each model
keeps its example's layer structure, initialisers, activations and dropout; widths and sizes are arguments.
Where each comes from, in google/flax:

* `MnistCNN`: examples/mnist/train.py before it moved to nnx (commit 0ef9abb2^, linen); `NnxMnistCNN`: the same
  network in nnx; `NnxMnistBNCNN`: examples/mnist/train.py now (nnx, BatchNorm, dropout).
* `ResNet`, `ResNetBlock`: examples/imagenet/models.py (its ResNet18 is ``stage_sizes=(2, 2, 2, 2)``; each
  block's last BatchNorm scale starts at zero). Its BatchNorm's ``axis_name='batch'`` (a ``pmap`` axis) is
  left out: one device.
* `VAE`: examples/vae/models.py (the hidden width and image size are arguments: 500 and 784 there);
  `NnxVAE`: examples/nnx_toy_examples/05_vae.py.
* `GraphConvNet`: examples/ogbg_molpcba/models.py (jraph).
* `ScanMLP`: examples/nnx_toy_examples/06_scan_over_layers.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph
import numpy as np
from flax import nnx

# ---------------------------------------------------------------------------- mnist


class MnistCNN(nn.Module):
    """examples/mnist/train.py (linen): conv, ReLU, average pooling, twice; a ReLU Dense; the logits."""

    features: tuple[int, int, int] = (32, 64, 256)

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(features=self.features[0], kernel_size=(3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(features=self.features[1], kernel_size=(3, 3))(x)), (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.relu(nn.Dense(features=self.features[2])(x))
        return nn.Dense(features=10)(x)


class NnxMnistCNN(nnx.Module):
    """`MnistCNN` in nnx (nnx.Conv, nnx.Linear)."""

    def __init__(self, features=(32, 64, 256), flat=3136, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, features[0], kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(features[0], features[1], kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(flat, features[2], rngs=rngs)
        self.linear2 = nnx.Linear(features[2], 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)  # flatten
        return self.linear2(nnx.relu(self.linear1(x)))


class NnxMnistBNCNN(nnx.Module):
    """examples/mnist/train.py (nnx): BatchNorm after each conv, dropout after the first conv and the hidden Dense;
    the dropout draws from the ``rngs`` passed to the call."""

    def __init__(self, features=(32, 64, 256), flat=3136, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, features[0], kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(features[0], rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(features[0], features[1], kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(features[1], rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(flat, features[2], rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(features[2], 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


# ---------------------------------------------------------------------------- imagenet


class ResNetBlock(nn.Module):
    """examples/imagenet/models.py's basic block: the last BatchNorm's scale starts at zero."""

    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNet V1.5 (examples/imagenet/models.py); ``ResNet(stage_sizes=(2, 2, 2, 2), ...)`` is its ResNet18."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


# ---------------------------------------------------------------------------- vae


class Encoder(nn.Module):
    """The VAE's encoder: a ReLU Dense, then the mean and the log-variance."""

    latents: int
    hidden: int = 500

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="fc1")(x))
        return nn.Dense(self.latents, name="fc2_mean")(x), nn.Dense(self.latents, name="fc2_logvar")(x)


class Decoder(nn.Module):
    """The VAE's decoder: a ReLU Dense, then the pixels' logits."""

    hidden: int = 500
    pixels: int = 784

    @nn.compact
    def __call__(self, z):
        return nn.Dense(self.pixels, name="fc2")(nn.relu(nn.Dense(self.hidden, name="fc1")(z)))


def reparameterize(rng, mean, logvar):
    return mean + jax.random.normal(rng, logvar.shape) * jnp.exp(0.5 * logvar)


class VAE(nn.Module):
    """examples/vae/models.py: encoder, a draw with the ``z_rng`` argument, decoder."""

    latents: int = 20
    hidden: int = 500
    pixels: int = 784

    @nn.compact
    def __call__(self, x, z_rng):
        mean, logvar = Encoder(self.latents, self.hidden, name="encoder")(x)
        recon_x = Decoder(self.hidden, self.pixels, name="decoder")(reparameterize(z_rng, mean, logvar))
        return recon_x, mean, logvar


class Loss(nnx.Variable):
    """05_vae.py's variable type of the KL term that the encoder stores during the call."""


class NnxEncoder(nnx.Module):
    """05_vae.py's ``Encoder``: its noise comes from the model's own ``rngs.noise`` stream."""

    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        x = jax.nn.relu(self.linear1(x.reshape((x.shape[0], -1))))
        mean, std = self.linear_mean(x), jnp.exp(self.linear_std(x))
        self.kl_loss = Loss(jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1)))
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class NnxDecoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z):
        return self.linear2(jax.nn.relu(self.linear1(z)))


class NnxVAE(nnx.Module):
    """examples/nnx_toy_examples/05_vae.py's ``VAE``: logits reshaped to the image."""

    def __init__(self, din, hidden_size, latent_size, output_shape, *, rngs: nnx.Rngs):
        self.output_shape = output_shape
        self.encoder = NnxEncoder(din, hidden_size, latent_size, rngs=rngs)
        self.decoder = NnxDecoder(latent_size, hidden_size, int(np.prod(output_shape)), rngs=rngs)

    def __call__(self, x):
        return jnp.reshape(self.decoder(self.encoder(x)), (-1, *self.output_shape))


# ---------------------------------------------------------------------------- ogbg_molpcba


def add_graphs_tuples(graphs: jraph.GraphsTuple, other: jraph.GraphsTuple) -> jraph.GraphsTuple:
    """Adds the nodes, edges and global features of ``other`` to ``graphs``."""
    return graphs._replace(
        nodes=graphs.nodes + other.nodes, edges=graphs.edges + other.edges, globals=graphs.globals + other.globals
    )


class MLP(nn.Module):
    """ogbg_molpcba's ``MLP``: Dense, activation, dropout, for each size."""

    feature_sizes: Sequence[int]
    dropout_rate: float = 0
    deterministic: bool = True
    activation: Callable = nn.relu

    @nn.compact
    def __call__(self, inputs):
        x = inputs
        for size in self.feature_sizes:
            x = self.activation(nn.Dense(features=size)(x))
            x = nn.Dropout(rate=self.dropout_rate, deterministic=self.deterministic)(x)
        return x


class GraphConvNet(nn.Module):
    """Node embedding, graph convolutions (self edges, an MLP update, skip connections, LayerNorm), mean pooling
    of each graph's nodes, a Dense decoder of the pooled globals."""

    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int
    dropout_rate: float = 0
    skip_connections: bool = True
    layer_norm: bool = True
    deterministic: bool = True
    pooling_fn: Callable = jraph.segment_mean

    def pool(self, graphs):
        n_graph = graphs.n_node.shape[0]
        indices = jnp.repeat(jnp.arange(n_graph), graphs.n_node, axis=0, total_repeat_length=graphs.nodes.shape[0])
        return graphs._replace(globals=self.pooling_fn(graphs.nodes, indices, n_graph))

    @nn.compact
    def __call__(self, graphs):
        processed = jraph.GraphMapFeatures(embed_node_fn=nn.Dense(self.latent_size))(graphs)
        for _ in range(self.message_passing_steps):
            mlp = MLP([self.latent_size] * self.num_mlp_layers, self.dropout_rate, self.deterministic)
            conv = jraph.GraphConvolution(update_node_fn=jraph.concatenated_args(mlp), add_self_edges=True)
            processed = add_graphs_tuples(conv(processed), processed) if self.skip_connections else conv(processed)
            if self.layer_norm:
                processed = processed._replace(nodes=nn.LayerNorm()(processed.nodes))
        processed = self.pool(processed)
        return jraph.GraphMapFeatures(embed_global_fn=nn.Dense(self.output_globals_size))(processed)


# ---------------------------------------------------------------------------- nnx scan over layers


class ScanBlock(nnx.Module):
    """06_scan_over_layers.py's ``Block``: Linear, BatchNorm, GELU; its dropout holds an rng stream of its own."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """Blocks made with ``nnx.vmap`` (rngs split per layer) and applied with ``nnx.scan``."""

    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return ScanBlock(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block: ScanBlock):
            return block(x), None

        x, _ = scan_fn(x, self.layers)
        return x
