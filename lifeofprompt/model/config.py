"""The numbers that define a Llama-architecture model, and the two models of the story.

Everything later (memory arithmetic, the roofline, the KV pool) is computed from a
``ModelConfig``, so one dataclass holds exactly the fields those computations need.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def num_parameters(self) -> int:
        """Parameters counted from the shapes (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o ; k, v
        mlp = 3 * h * i
        norms = 2 * h
        per_layer = attn + mlp + norms
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + lm_head + h

    @classmethod
    def from_hf(cls, hf_config, name: str | None = None) -> ModelConfig:
        """Read a transformers ``LlamaConfig`` (or anything with the same attribute names)."""
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_theta = getattr(hf_config, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            name=name or getattr(hf_config, "_name_or_path", "") or "llama",
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
        )


# TinyLlama/TinyLlama-1.1B-Chat-v1.0, the story's model (values from its config.json).
TINYLLAMA_1_1B = ModelConfig(
    name="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=22,
    num_heads=32,
    num_kv_heads=4,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
