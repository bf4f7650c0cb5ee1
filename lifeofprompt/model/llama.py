"""The Llama decoder in plain torch ops: one implementation for every stage of the series.

RMSNorm → rotary embeddings → grouped-query attention → SwiGLU, stacked ``num_layers``
times. The forward runs a *flat* batch (token ids ``[T]``, positions ``[T]``) and asks an
attention-metadata object (``lifeofprompt.model.attention``) where each sequence's keys and values
live, so the same layers serve the no-cache forward of chapter 02, the contiguous cache of
chapter 04 and the paged cache of the engine. Logits are computed only for the rows the
metadata asks for: a decode step needs one row per sequence, not one per token.

Weights load from any Hugging Face Llama checkpoint; q/k/v and gate/up are fused into one
matrix each so a decode step launches fewer, larger matrix products.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionMetadata, NoCacheMetadata
from .config import ModelConfig
from .forward_path import ForwardPath
from .linear import Linear

# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Scale each row to unit root-mean-square, then by a learned weight (computed in fp32)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and hasattr(nn.functional, "rms_norm"):
            # One fused call, the same numbers as the spelled-out form below (torch >= 2.4).
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate query/key pairs by an angle proportional to the token's position (RoPE, half-split layout).

    The cos/sin table is computed once for every position; a forward looks up its rows once
    (``at``) and every layer rotates its queries and keys together with them (``rotate``).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _apply(self, fn, recurse=True):
        """``model.to(device)`` moves the table; ``model.to(torch.bfloat16)`` does not round it: the
        angles stay fp32 in every dtype (``rotate``, the fused Triton kernel and the C step all compute
        in fp32), so every loader, every shard of a split model and every rank hold the same table."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` rows of these positions, shaped ``[T, 1, head_dim / 2]`` to broadcast over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x``: ``[T, heads, head_dim]``; returns it rotated, same dtype."""
        cos, sin = cos_sin
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.to(x.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by its rows' ``positions``."""
        return self.rotate(x, self.at(positions))


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: ``num_heads`` queries share ``num_kv_heads`` keys/values."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, hidden, cos_sin, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        # Queries and keys sit side by side in the fused output: rotate them in one go.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.rotate(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        context = meta.attend(self.layer_idx, q, k, v)  # [T, heads, head_dim]
        return self.o_proj(context.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, cos_sin, meta):
        """``cos_sin``: the rotary rows of this forward's positions (``RotaryEmbedding.at``)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ----------------------------------------------------------------------------- the model


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward(ids[T], positions[T], meta)`` for the engine, ``model(ids[B, S])`` for people."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.source = "unloaded"  # where the weights came from, for every printed figure
        self.is_random = False  # True for seeded random weights (speed and memory work only)
        self.dtype_reason = ""  # how load_model chose the dtype (for the start-up log)
        self.quantization: str | None = None  # "gguf", "q8_0" or "q4_1" once matrices are blocks (quantized_linear.py)
        self.quantization_reason = ""  # how load_model chose it (for the start-up log)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'): with block matrices the weights have no single dtype."""
        return self.norm.weight.dtype

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, path=ForwardPath.TORCH
    ) -> torch.Tensor:
        """Final normalised hidden state of every row ``[T, hidden]``, computed the ``path`` way
        (``forward_path.ForwardPath``): the torch layers below; ``FUSED``, the same with fused Triton
        element-wise kernels (``fused_hidden_states``); ``C_STEP``, a small step of the paged engine in
        one C call (``cpu_decode.py``: same layers, same weights; ``C_STEP_ROW_MAJOR`` without its
        packed weight copies)."""
        path = ForwardPath(path)
        if path is ForwardPath.FUSED:
            return self.fused_hidden_states(input_ids, positions, meta)
        if path is not ForwardPath.TORCH:
            from .cpu_decode import decode_hidden_states

            return decode_hidden_states(self, input_ids, positions, meta, packed=path is ForwardPath.C_STEP)
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.at(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos_sin, meta)
        return self.norm(hidden)

    def fused_hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``hidden_states`` with the element-wise steps as fused Triton kernels (``kernels/fused.py``).

        The same modules, weights and order of operations; only the small steps between the
        matrix products change. At batch 1 on a GPU the ~55 kernels of a layer cost more than its
        matrix products (``benchmarks/NOTES.md``), most of them tiny element-wise ones; here a
        layer's element-wise work is four launches: residual add + RMSNorm twice, the rotary of q
        and k in place inside the qkv output, and SiLU × up. The residual stream lives in one
        tensor updated in place, and each layer's last residual add is done by the next layer's input norm (the
        last one by the final norm).
        """
        from ..kernels import fused

        cos_sin = self.rotary.at(positions)
        residual = self.embed_tokens(input_ids)
        sublayer_out = None
        for layer in self.layers:
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            if sublayer_out is None:
                normed = fused.rms_norm(residual, norm.weight, norm.eps)
            else:
                normed, residual = fused.add_rms_norm(sublayer_out, residual, norm.weight, norm.eps)
            qkv = attn.qkv_proj(normed)
            qk = qkv[:, : attn.q_size + attn.kv_size].view(-1, attn.num_heads + attn.num_kv_heads, attn.head_dim)
            q, k = fused.rotary_qk(qk, *cos_sin).split([attn.num_heads, attn.num_kv_heads], dim=1)
            v = qkv[:, attn.q_size + attn.kv_size :].view(-1, attn.num_kv_heads, attn.head_dim)
            sublayer_out = attn.o_proj(meta.attend(attn.layer_idx, q, k, v).reshape(-1, attn.q_size))
            post = layer.post_attention_layernorm
            normed, residual = fused.add_rms_norm(sublayer_out, residual, post.weight, post.eps)
            sublayer_out = mlp.down_proj(fused.silu_mul(mlp.gate_up_proj(normed)))
        return fused.add_rms_norm(sublayer_out, residual, self.norm.weight, self.norm.eps)[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
        path: ForwardPath = ForwardPath.TORCH,
    ) -> torch.Tensor:
        """Flat form: logits ``[len(meta.logits_indices), vocab]`` (all rows when it is None), the
        layers run the ``path`` way (``hidden_states``).

        Convenience form (``input_ids`` is ``[batch, seq]``, no metadata): logits ``[batch, seq, vocab]``.
        """
        if input_ids.dim() == 2 and meta is None:
            batch, seq = input_ids.shape
            meta = NoCacheMetadata.for_lengths([seq] * batch, device=input_ids.device)
            positions = torch.arange(seq, device=input_ids.device).repeat(batch)
            return self.forward(input_ids.reshape(-1), positions, meta).view(batch, seq, -1)
        hidden = self.hidden_states(input_ids, positions, meta, path)
        if meta.logits_indices is not None:
            hidden = hidden[meta.logits_indices]
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------- weights

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face Llama state dict in, fusing q/k/v and gate/up as they arrive."""
        own = dict(self.named_parameters())
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            layer.self_attn.qkv_proj.weight.copy_(torch.cat([tensors.pop(attn + f"{n}_proj.weight") for n in "qkv"]))
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([tensors.pop(mlp + f"{n}_proj.weight") for n in ("gate", "up")])
            )
        renames = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            ours = renames.get(name, name.removeprefix("model."))
            if ours == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if ours not in own:
                raise KeyError(f"checkpoint tensor {name!r} has no place in LlamaForCausalLM")
            own[ours].copy_(tensor)
