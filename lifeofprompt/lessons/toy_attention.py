"""One forward pass, small enough to see every number (notebook 02).

Part 1, the toy: "a sunset is" as three 4-dimensional vectors. One attention head computes
``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, the 3×3 scores ``Q Kᵀ / √4``, hides the future
with a causal mask, turns each row into weights with a softmax and mixes the values into the
context. Only the *last* row of the context goes on to the LM head: the next token depends
on it alone, while it needs *every* row of K and V. That asymmetry is the KV cache of
notebook 04.

Part 2, the real thing: ``layer_walkthrough`` runs one decoder layer of ``lifeofprompt.model.llama``
with its own weights, piece by piece (RMSNorm, RoPE, grouped-query attention, SwiGLU), and
returns every intermediate so the notebook can print shapes and check the pieces add up to
the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOY_TOKENS = ("a", "sunset", "is")
TOY_VOCAB = ("a", "sunset", "is", "extremely", "beautiful", "red", "over", "the")
# The toy's weights are random. Any seed shows the mechanics; with this one the argmax happens
# to be "extremely", the word the story's model picked.
TOY_SEED = 8

# ----------------------------------------------------------------------------- part 1: the toy


@dataclass
class ToyAttention:
    """Every matrix of one causal attention head on three tokens, then the LM head."""

    tokens: tuple[str, ...]
    vocab: tuple[str, ...]
    X: torch.Tensor  # [3, 4] token vectors
    W_Q: torch.Tensor  # [4, 4]
    W_K: torch.Tensor
    W_V: torch.Tensor
    Q: torch.Tensor  # [3, 4]
    K: torch.Tensor
    V: torch.Tensor
    scores: torch.Tensor  # [3, 3] Q Kᵀ / sqrt(d)
    mask: torch.Tensor  # [3, 3] bool, True where a token may look (itself and earlier)
    masked: torch.Tensor  # scores with -inf above the diagonal
    weights: torch.Tensor  # [3, 3] softmax of each row
    context: torch.Tensor  # [3, 4] weights @ V
    W_LM: torch.Tensor  # [4, vocab] the LM head
    logits: torch.Tensor  # [vocab] last context row @ W_LM

    @property
    def next_token(self) -> str:
        return self.vocab[int(self.logits.argmax())]


def toy_attention(seed: int = TOY_SEED, tokens=TOY_TOKENS, vocab=TOY_VOCAB, dim: int = 4) -> ToyAttention:
    """Build the toy from seeded random weights, rounded to one decimal so the heatmaps stay readable."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.8).round(decimals=1) + 0.0  # + 0.0 turns -0.0 into 0.0

    embedding = rand(len(vocab), dim)
    X = embedding[[vocab.index(t) for t in tokens]]
    W_Q, W_K, W_V, W_LM = rand(dim, dim), rand(dim, dim), rand(dim, dim), rand(dim, len(vocab))
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    scores = Q @ K.T / dim**0.5
    n = len(tokens)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    masked = scores.masked_fill(~mask, float("-inf"))
    weights = masked.softmax(dim=-1)
    context = weights @ V
    logits = context[-1] @ W_LM
    return ToyAttention(
        tuple(tokens), tuple(vocab), X, W_Q, W_K, W_V, Q, K, V, scores, mask, masked, weights, context, W_LM, logits
    )


def plot_matrix(
    ax,
    matrix: torch.Tensor,
    title: str,
    row_labels=None,
    col_labels=None,
    highlight_rows=(),
    outline_all: bool = False,
    cmap: str = "RdBu_r",
    fmt: str = "{:.2f}",
):
    """A heatmap with its values written in, its shape in the title, chosen rows boxed in red.

    ``-inf`` entries (the causal mask) are drawn grey and labelled ``-inf``. ``outline_all``
    draws a green frame round the whole matrix (K and V: every row is needed).
    """
    import matplotlib
    import matplotlib.patches as patches

    m = matrix.detach().float()
    finite = m[torch.isfinite(m)]
    limit = float(finite.abs().max()) if finite.numel() else 1.0
    shown = torch.where(torch.isfinite(m), m, torch.tensor(float("nan")))
    low = -limit if cmap == "RdBu_r" else 0.0  # diverging map centred on 0; weights start at 0
    colormap = matplotlib.colormaps[cmap].with_extremes(bad="#d9d9d9")  # masked (-inf) cells in grey
    image = ax.imshow(shown.numpy(), cmap=colormap, vmin=low, vmax=limit or 1)
    rows, cols = m.shape
    for i in range(rows):
        for j in range(cols):
            v = float(m[i, j])
            text = "-inf" if v == float("-inf") else fmt.format(v)
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if abs(v) > 0.6 * limit and v != float("-inf") else "black",
            )
    ax.set_xticks(range(cols), col_labels if col_labels is not None else range(cols), fontsize=8)
    ax.set_yticks(range(rows), row_labels if row_labels is not None else range(rows), fontsize=8)
    ax.set_title(f"{title}  [{rows}×{cols}]", fontsize=9)
    for r in highlight_rows:
        ax.add_patch(patches.Rectangle((-0.5, r - 0.5), cols, 1, fill=False, edgecolor="red", linewidth=2.5))
    if outline_all:
        ax.add_patch(
            patches.Rectangle((-0.5, -0.5), cols, rows, fill=False, edgecolor="green", linewidth=2.5, linestyle="--")
        )
    return image


def plot_projections(toy: ToyAttention):
    """X and the three weight matrices, then Q, K and V. Red: the last token's row; green: all of K and V."""
    import matplotlib.pyplot as plt

    dims = [f"d{i}" for i in range(toy.X.shape[1])]
    last = len(toy.tokens) - 1
    fig, axes = plt.subplots(2, 4, figsize=(13, 6.2))
    plot_matrix(axes[0, 0], toy.X, "X (token vectors)", toy.tokens, dims, highlight_rows=[last])
    for ax, (name, w) in zip(axes[0, 1:], [("W_Q", toy.W_Q), ("W_K", toy.W_K), ("W_V", toy.W_V)]):
        plot_matrix(ax, w, name, dims, dims, fmt="{:.1f}")
    plot_matrix(axes[1, 0], toy.Q, "Q = X·W_Q", toy.tokens, dims, highlight_rows=[last])
    plot_matrix(axes[1, 1], toy.K, "K = X·W_K", toy.tokens, dims, outline_all=True)
    plot_matrix(axes[1, 2], toy.V, "V = X·W_V", toy.tokens, dims, outline_all=True)
    axes[1, 3].axis("off")
    axes[1, 3].text(
        0,
        0.5,
        "red box: the last token's row,\nthe only query the next token needs\n\n"
        "green frame: every row of K and V,\nall needed by that query",
        fontsize=10,
        va="center",
    )
    fig.suptitle(f'"{" ".join(toy.tokens)}": one attention head, projections (random toy weights)', fontsize=11)
    fig.tight_layout()
    return fig


def plot_attention(toy: ToyAttention):
    """Scores, the causal mask applied, softmax weights, context, and the last row's logits."""
    import matplotlib.pyplot as plt

    dims = [f"d{i}" for i in range(toy.X.shape[1])]
    last = len(toy.tokens) - 1
    d = toy.X.shape[1]
    fig = plt.figure(figsize=(13, 7.6))
    grid = fig.add_gridspec(2, 4, height_ratios=[1, 0.9])
    axes = [fig.add_subplot(grid[0, i]) for i in range(4)]
    plot_matrix(axes[0], toy.scores, f"scores = Q·Kᵀ/√{d}", toy.tokens, toy.tokens, highlight_rows=[last])
    plot_matrix(axes[1], toy.masked, "causal mask applied", toy.tokens, toy.tokens, highlight_rows=[last])
    plot_matrix(
        axes[2], toy.weights, "weights = softmax(rows)", toy.tokens, toy.tokens, highlight_rows=[last], cmap="Blues"
    )
    plot_matrix(axes[3], toy.context, "context = weights·V", toy.tokens, dims, highlight_rows=[last])
    for ax in axes[:3]:
        ax.set_xlabel("key (looked at)", fontsize=8)
    axes[0].set_ylabel("query (looking)", fontsize=8)
    head_ax = fig.add_subplot(grid[1, 0])
    plot_matrix(head_ax, toy.W_LM.T, "W_LM (transposed)", toy.vocab, dims, fmt="{:.1f}")
    ax = fig.add_subplot(grid[1, 1:])
    logits = toy.logits.numpy()
    best = int(toy.logits.argmax())
    colors = ["#e76f51" if i == best else "#8ab6d6" for i in range(len(logits))]
    ax.bar(range(len(logits)), logits, color=colors)
    ax.set_xticks(range(len(logits)), toy.vocab)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylabel("logit")
    ax.set_title(
        f"last context row [1×{d}] · W_LM [{d}×{len(toy.vocab)}] → {len(toy.vocab)} logits; "
        f"argmax = {toy.next_token!r}",
        fontsize=10,
    )
    fig.suptitle("Attention of the last token decides the next one (causal: no token sees the future)", fontsize=11)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- part 2: a real layer


@torch.no_grad()
def layer_walkthrough(model, token_ids: list[int], layer_idx: int = 0) -> dict[str, torch.Tensor]:
    """Run decoder layer ``layer_idx`` of ``model`` on ``token_ids`` one named step at a time.

    Uses the layer's own weights and modules, but spells out attention (causal softmax with
    each key/value head shared by ``group_size`` query heads) instead of calling the attention
    metadata, so the notebook can show every shape. ``"layer_output"`` equals what the layer
    itself returns (tested); ``"reference_output"`` is that value.
    """
    from ..model.attention import NoCacheMetadata

    config = model.config
    layer = model.layers[layer_idx]
    ids = torch.tensor(token_ids, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    meta = NoCacheMetadata.for_lengths([len(ids)], model.device)
    hidden = layer_input(model, layer_idx, ids, positions, meta)
    out = {"layer_input": hidden}
    attn = layer.self_attn
    out["normed"] = layer.input_layernorm(hidden)
    q, k, v = attn.qkv_proj(out["normed"]).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    out["q"] = q.view(-1, attn.num_heads, attn.head_dim)
    out["k"] = k.view(-1, attn.num_kv_heads, attn.head_dim)
    out["v"] = v.view(-1, attn.num_kv_heads, attn.head_dim)
    out["q_rope"] = model.rotary(positions, out["q"])
    out["k_rope"] = model.rotary(positions, out["k"])
    group = config.num_heads // config.num_kv_heads
    k_shared = out["k_rope"].repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v_shared = out["v"].repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", out["q_rope"], k_shared) / attn.head_dim**0.5
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool, device=model.device).tril()
    out["attn_weights"] = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [heads, T, T]
    out["context"] = torch.einsum("hqk,khd->qhd", out["attn_weights"], v_shared)
    out["attn_output"] = attn.o_proj(out["context"].reshape(len(ids), -1))
    out["after_attention"] = hidden + out["attn_output"]
    normed2 = layer.post_attention_layernorm(out["after_attention"])
    gate, up = layer.mlp.gate_up_proj(normed2).split(config.intermediate_size, dim=-1)
    out["gate"], out["up"] = gate, up
    out["swiglu"] = torch.nn.functional.silu(gate) * up
    out["layer_output"] = out["after_attention"] + layer.mlp.down_proj(out["swiglu"])
    attended, residual = layer(hidden, None, model.rotary.at(positions), meta)
    out["reference_output"] = attended + residual  # the layer hands its output over as these two halves
    return out


def layer_input(model, layer_idx: int, ids, positions, meta) -> torch.Tensor:
    """What layer ``layer_idx`` receives in the model's own forward: the residual stream before it (the
    layers pass it on as a sublayer output and the stream so far, summed here)."""
    seen = {}

    def keep(layer, args):
        hidden, residual = args[0], args[1]
        seen["input"] = hidden if residual is None else hidden + residual
        raise StopForward

    handle = model.layers[layer_idx].register_forward_pre_hook(keep)
    try:
        model.hidden_states(ids, positions, meta)
    except StopForward:
        pass
    finally:
        handle.remove()
    return seen["input"]


class StopForward(Exception):
    """Raised by ``layer_input``'s hook: the layers after the one asked for need not run."""


def rope_scores(rotary, q: torch.Tensor, k: torch.Tensor, num_positions: int) -> torch.Tensor:
    """``[m, n]`` = (q rotated to position m) · (k rotated to position n) for one head's vectors.

    RoPE makes this depend only on ``m - n``: the matrix is constant along every diagonal.
    """
    positions = torch.arange(num_positions)
    q_rot = rotary(positions, q.expand(num_positions, 1, -1))[:, 0]
    k_rot = rotary(positions, k.expand(num_positions, 1, -1))[:, 0]
    return q_rot @ k_rot.T


def plot_rope(rotary, head_dim: int, num_positions: int = 24, seed: int = 0):
    """Heatmap of ``rope_scores`` for a random q and k: the stripes show relative position at work."""
    import matplotlib.pyplot as plt

    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    scores = rope_scores(rotary, q, k, num_positions)
    fig, ax = plt.subplots(figsize=(5.5, 4.6))
    image = ax.imshow(scores.numpy(), cmap="RdBu_r")
    fig.colorbar(image, ax=ax, label="q·k after rotation")
    ax.set_xlabel("key position n")
    ax.set_ylabel("query position m")
    ax.set_title(
        "RoPE: the same q and k at every pair of positions;\nconstant along diagonals (depends on m − n only)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_gqa(num_heads: int, num_kv_heads: int):
    """Which query heads read which key/value head (grouped-query attention)."""
    import matplotlib.pyplot as plt

    group = num_heads // num_kv_heads
    fig, ax = plt.subplots(figsize=(7, 2.4))
    colors = plt.cm.Set2.colors
    for h in range(num_heads):
        kv = h // group
        qx = h
        kx = kv * group + (group - 1) / 2
        ax.add_patch(plt.Rectangle((qx - 0.4, 0.6), 0.8, 0.5, color=colors[kv % len(colors)]))
        ax.text(qx, 0.85, f"Q{h}", ha="center", va="center", fontsize=8)
        ax.plot([qx, kx], [0.6, 0.1], color="gray", linewidth=0.8)
    for kv in range(num_kv_heads):
        kx = kv * group + (group - 1) / 2
        ax.add_patch(plt.Rectangle((kx - 0.9, -0.4), 1.8, 0.5, color=colors[kv % len(colors)]))
        ax.text(kx, -0.15, f"K{kv}, V{kv}", ha="center", va="center", fontsize=8)
    ax.set_xlim(-1, num_heads)
    ax.set_ylim(-0.6, 1.3)
    ax.axis("off")
    ax.set_title(
        f"grouped-query attention: {num_heads} query heads share {num_kv_heads} key/value heads "
        f"({group} each), so the KV cache is {group}× smaller",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
