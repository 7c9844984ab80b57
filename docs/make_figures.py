"""Make the figures of the documentation: ``python docs/make_figures.py`` writes docs/_static/*.png.

* ``reduction_graph.png``: the reduction graph of a 3-4-3-2 ReLU MLP as `pathspace_jax.trace` finds it,
  with the skeleton `pathspace_jax` chose (incoming skeleton edges, and the gauge: the outgoing ones) and
  one basis path.
* ``sgd_vs_gsgd.png``: training loss of SGD and G-SGD on a small regression problem, from a Flax
  initialisation and from a node-wise rescaling of it (the same function).

Both are computed with the library; the figures are committed so that building the docs needs no training.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import pathspace_jax as pj
from pathspace_jax.skeleton import skeleton

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).parent / "_static"


class MLP(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


def reduction_graph():
    model = MLP((4, 3, 2))
    x = jnp.ones((1, 3))
    params = model.init(jax.random.key(0), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    sk = skeleton(space)

    # node positions: one column per group, the bias node at the bottom left
    pos = {0: (0.5, -1.2)}
    for col, g in enumerate(space.groups):
        for k in range(g.size):
            pos[g.offset + k] = (2.0 * col, (g.size - 1) / 2 - k)
    kinds = {g.offset + k: g.kind for g in space.groups for k in range(g.size)}

    edges = []  # (src, dst, leaf index, flat index)
    for li, leaf in enumerate(space.leaves):
        for flat, (s, d) in enumerate(zip(np.ravel(leaf.src), np.ravel(leaf.dst))):
            edges.append((int(s), int(d), li, flat))
    in_skel = {(int(sk.in_leaf[v]), int(sk.in_flat[v])) for v in range(sk.num_nodes) if sk.hidden[v]}
    gauge = {(int(sk.out_leaf[v]), int(sk.out_flat[v])) for v in range(sk.num_nodes) if sk.hidden[v]}

    # one basis path: a non-skeleton edge e = u -> v in the middle layer, with u's incoming chain and
    # v's outgoing chain
    g1, g2 = space.groups[1], space.groups[2]
    kernel = next(i for i, leaf in enumerate(space.leaves) if leaf.src_groups == (1,) and leaf.dst_groups == (2,))
    e = next(
        (s, d, li, f)
        for s, d, li, f in edges
        if li == kernel and (li, f) not in in_skel | gauge and s == g1.offset + 3 and d >= g2.offset
    )
    path = {(e[2], e[3])}
    u = e[0]
    while sk.hidden[u]:
        path.add((int(sk.in_leaf[u]), int(sk.in_flat[u])))
        u = int(sk.parent[u])
    v = e[1]
    while sk.hidden[v]:
        path.add((int(sk.out_leaf[v]), int(sk.out_flat[v])))
        v = int(sk.child[v])

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for s, d, li, f in edges:
        (x0, y0), (x1, y1) = pos[s], pos[d]
        key = (li, f)
        if key in path:
            ax.plot([x0, x1], [y0, y1], color="tab:red", lw=7, alpha=0.3, zorder=4, solid_capstyle="round")
        if key in gauge:
            style = dict(color="tab:orange", lw=2.2, zorder=2)
        elif key in in_skel:
            style = dict(color="tab:blue", lw=2.2, zorder=2)
        elif s == 0:
            style = dict(color="0.75", lw=0.6, ls=":", zorder=0)
        else:
            style = dict(color="0.7", lw=0.8, zorder=0)
        ax.plot([x0, x1], [y0, y1], **style)
    colours = {"input": "white", "hidden": "0.85", "output": "white", "pinned": "tab:purple"}
    for n, (px, py) in pos.items():
        face = "black" if n == 0 else colours[kinds[n]]
        ax.scatter([px], [py], s=260, c=face, edgecolors="black", zorder=3)
    ax.annotate("bias node", pos[0], xytext=(10, -4), textcoords="offset points", fontsize=9)
    for col, g in enumerate(space.groups):
        ax.text(2.0 * col, 2.3, f"{g.name}\n{g.kind}", ha="center", fontsize=9)
    handles = [
        plt.Line2D([], [], color="tab:blue", lw=2.2, label="incoming skeleton edge"),
        plt.Line2D([], [], color="tab:orange", lw=2.2, label="outgoing skeleton edge (gauge)"),
        plt.Line2D([], [], color="tab:red", lw=7, alpha=0.3, label="one basis path"),
        plt.Line2D([], [], color="0.7", lw=0.8, label="other weight"),
        plt.Line2D([], [], color="0.75", lw=0.6, ls=":", label="bias"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    ax.set_title(
        f"3-4-3-2 ReLU MLP: m = {space.num_params} parameters, H = {space.num_hidden} hidden nodes, "
        f"m - H = {space.num_coords} basis paths",
        fontsize=10,
    )
    ax.set_xlim(-0.6, 6.8)
    ax.set_ylim(-1.6, 2.8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT / "reduction_graph.png", dpi=110)
    plt.close(fig)


def sgd_vs_gsgd(steps=400, lr=0.05):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 8)), jnp.float32)
    teacher = MLP((16, 1))
    y = teacher.apply(teacher.init(jax.random.key(1), x), x)
    model = MLP((32, 32, 1))
    params = model.init(jax.random.key(0), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, x)
    unbalanced = pj.random_rescale(space, params, jax.random.key(2), max_exponent=3)
    assert bool(jnp.allclose(fn(params, x), fn(unbalanced, x), rtol=1e-6, atol=0))

    def loss_fn(p):
        return jnp.mean((fn(p, x) - y) ** 2)

    def run(tx, p):
        @jax.jit
        def step(p, s):
            loss, g = jax.value_and_grad(loss_fn)(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        s, losses = tx.init(p), []
        for _ in range(steps):
            p, s, loss = step(p, s)
            losses.append(float(loss))
        return np.array(losses)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, tx, colour in (("SGD", optax.sgd(lr), "tab:gray"), ("G-SGD", pj.g_sgd(space, lr), "tab:blue")):
        for start, p0, ls in (("Flax init", params, "-"), ("rescaled init (same function)", unbalanced, "--")):
            losses = run(tx, p0)
            label = f"{name}, {start}"
            if not np.all(losses < 1e3):
                label += f": loss > 1e3 from step {int(np.argmax(~(losses < 1e3)))}"
            ax.semilogy(np.where(np.isfinite(losses), losses, np.nan), ls=ls, color=colour, label=label)
    ax.set_ylim(1e-3, 1e3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title(f"8-32-32-1 ReLU MLP, full batch, learning rate {lr}", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(OUT / "sgd_vs_gsgd.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    reduction_graph()
    sgd_vs_gsgd()
    print("wrote", *sorted(p.name for p in OUT.glob("*.png")))
