"""The shortest complete Flax nnx training loop with a path-space optimiser: G-Adam on the digits.

Trace the ``nnx.Param`` state once, hand the transformation to ``nnx.Optimizer``, train under
``nnx.jit``. Any other optimiser of the library goes in the same place (``pj.g_sgd``, ``pj.path_sgd``;
``pj.ddp_sgd`` also wants the batch: ``optimizer.update(model, grads, inputs=x)``).

Run:  pip install -e ".[examples]" && python examples/quickstart_nnx.py
"""

import argparse

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import pathspace_jax as pj


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x, y = (digits.data[order] / 16.0).astype(np.float32), digits.target[order]
    x_tr, y_tr, x_te, y_te = x[:1400], y[:1400], x[1400:], y[1400:]

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    space = pj.trace(lambda p, x: nnx.merge(graphdef, p)(x), params, x_tr[:1])
    optimizer = nnx.Optimizer(model, pj.g_adam(space, 3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    for epoch in range(10):
        order = rng.permutation(len(x_tr))
        losses = [step(model, optimizer, x_tr[i], y_tr[i]) for i in np.array_split(order, len(order) // 64)]
        accuracy = float((model(x_te).argmax(-1) == y_te).mean())
        print(f"epoch {epoch + 1:2d}: training loss {float(jax.numpy.mean(jax.numpy.stack(losses))):.4f}, "
              f"test accuracy {accuracy:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
