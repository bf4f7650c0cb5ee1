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

from .attention import AttentionMetadata, NoCacheMetadata, PagedCacheMetadata
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, SiluAndMul
from .linear import Linear

# ----------------------------------------------------------------------------- the decoder layer


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
        q, k = RotaryEmbedding.rotate_qk(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
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
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, with the residual
    stream carried beside the output: each add happens inside the next norm (``layers.RMSNorm``)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, residual, cos_sin, meta):
        """``(sublayer output, residual stream)`` after this layer, whose sum is the layer's output;
        ``residual`` is None in the first layer (``hidden`` is then the stream itself). ``cos_sin``: the
        rotary rows of this forward's positions (``RotaryEmbedding.at``)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
        self.cpu_step = None  # on a CPU, the layers in one C call for small steps (cpu/c_step.py: CStep)
        self.c_step_layout = None  # the C step's weight layout if it ran the last whole step, else None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'): with block matrices the weights have no single dtype."""
        return self.norm.weight.dtype

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        last: bool = True,
    ) -> torch.Tensor:
        """Final normalised hidden state of every row ``[T, hidden]``: the embedding, the decoder layers in
        order (the package's only loop over them) and the final norm.

        On a CPU the start-up may give the model a C step (``self.cpu_step``, ``cpu/c_step.py``): the
        same layers and weights in one C call, for the small steps over the engine's paged pool it
        measured faster there (any other metadata, e.g. chapter 04's contiguous cache, runs the loop).

        A pipeline stage runs the same loop over its slice of the layers: ``hidden`` is what the stage
        before sent (else the embedding of ``input_ids``); ``last=False`` returns the residual stream for
        the next stage instead of normalising it."""
        whole_step = hidden is None and last and isinstance(meta, PagedCacheMetadata)  # the C step reads the pool
        if self.cpu_step is not None and whole_step and self.cpu_step.takes(input_ids.shape[0]):
            self.c_step_layout = self.cpu_step.layout_for(input_ids.shape[0])  # the step's trace tells it
            return self.cpu_step.hidden_states(self, input_ids, positions, meta, self.c_step_layout)
        self.c_step_layout = None
        hidden = self.embed_tokens(input_ids) if hidden is None else hidden
        cos_sin = self.rotary.at(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, meta)
        if residual is None:  # no layers
            return self.norm(hidden) if last else hidden
        return self.norm(hidden, residual)[0] if last else hidden + residual

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Flat form: logits ``[len(meta.logits_indices), vocab]`` (all rows when it is None).

        Convenience form (``input_ids`` is ``[batch, seq]``, no metadata): logits ``[batch, seq, vocab]``.
        """
        if input_ids.dim() == 2 and meta is None:
            batch, seq = input_ids.shape
            meta = NoCacheMetadata.for_lengths([seq] * batch, device=input_ids.device)
            positions = torch.arange(seq, device=input_ids.device).repeat(batch)
            return self.forward(input_ids.reshape(-1), positions, meta).view(batch, seq, -1)
        hidden = self.hidden_states(input_ids, positions, meta)
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
