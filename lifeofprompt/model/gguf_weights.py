"""A GGUF file's weights as they are stored: Q4_1 and Q8_0 matrices kept as blocks, norms as floats.

``load_model(..., quantization="gguf")`` builds the model from here instead of from the dequantized
fp32 copy. Three things differ from a Hugging Face checkpoint, and each is done on whole rows of
blocks, so nothing is rounded again:

* **names**: ``blk.3.attn_q.weight`` is layer 3's ``q_proj``, ``token_embd`` the embedding (and, in a
  tied model, the LM head), ``output_norm`` the final norm;
* **the rotary row order**: llama.cpp's converter stores ``attn_q`` and ``attn_k`` with the two
  halves of every head's rotary pairs interleaved (it rotates adjacent pairs; Hugging Face rotates
  halves). transformers undoes it at load; we reorder the same rows (``unpermute_order``);
* **fusion**: q, k, v become one ``qkv`` matrix and gate, up one ``gate_up``, by stacking rows of blocks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..errors import ModelNotFoundError
from .block_formats import BlockWeight, concatenate, from_gguf_bytes

BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_1": "q4_1"}
FLOAT_TYPES = ("F32", "F16", "BF16")


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of a q or k matrix with ``heads`` heads.

    Within each head the converter stored row ``2 j + s`` (pair ``j``, side ``s``) where Hugging Face
    keeps row ``s * D / 2 + j``; new row ``i`` is old row ``order[i]``.
    """
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


@functools.cache
def read_tensors(path: str, mtime_ns: int, size: int) -> dict:
    """A GGUF's tensors by name, read once per process and file version (its time and size are in the key): gguf's
    reader takes seconds to map a file of hundreds of tensors, and every load of the same file would pay it again
    (each tensor is copied out, never written)."""
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


class GGUFTensors:
    """The tensors of one GGUF file by name, each as blocks or as a float tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        stat = self.path.stat()
        self.tensors = read_tensors(str(self.path.resolve()), stat.st_mtime_ns, stat.st_size)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def floats(self, name: str) -> torch.Tensor:
        """A float tensor as stored (F32, F16 or BF16), in fp32, rows first."""
        tensor = self.tensors[name]
        kind = self.type_of(name)
        data = torch.from_numpy(tensor.data.copy())
        if kind == "BF16":
            data = data.view(torch.bfloat16)
        elif kind not in FLOAT_TYPES:
            raise ModelNotFoundError(f"{self.path.name}: {name} is {kind}, not a float tensor")
        return data.float().reshape([int(n) for n in reversed(tensor.shape)])

    def blocks(self, name: str) -> BlockWeight:
        """A Q8_0 or Q4_1 matrix as planes of blocks (``block_formats.from_gguf_bytes``)."""
        tensor, kind = self.tensors[name], self.type_of(name)
        if kind not in BLOCK_TYPES:
            raise ModelNotFoundError(
                f"{self.path.name} stores {name} as {kind}; lifeofprompt keeps only Q8_0 and Q4_1 blocks as they "
                "are: load it with quantization=None (dequantized to floats) or 'q8_0' / 'q4_1' (quantized again)"
            )
        in_features = int(tensor.shape[0])
        return from_gguf_bytes(torch.from_numpy(tensor.data.copy()), BLOCK_TYPES[kind], in_features)


def matrix_blocks(gguf: GGUFTensors, name: str, config) -> BlockWeight:
    """One matrix's blocks, with q and k rows put back in Hugging Face's rotary order."""
    blocks = gguf.blocks(name)
    if name.endswith("attn_q.weight"):
        return blocks.permute_rows(unpermute_order(blocks.out_features, config.num_heads))
    if name.endswith("attn_k.weight"):
        return blocks.permute_rows(unpermute_order(blocks.out_features, config.num_kv_heads))
    return blocks


def layer_blocks(gguf: GGUFTensors, config, layer: int) -> dict[str, BlockWeight]:
    """Layer ``layer``'s four matrices, fused as the model holds them (``quantized_linear.LAYER_MATRICES``)."""
    name = lambda part: f"blk.{layer}.{part}.weight"  # noqa: E731
    fused = lambda *parts: concatenate([matrix_blocks(gguf, name(p), config) for p in parts])  # noqa: E731
    return {
        "self_attn.qkv_proj": fused("attn_q", "attn_k", "attn_v"),
        "self_attn.o_proj": matrix_blocks(gguf, name("attn_output"), config),
        "mlp.gate_up_proj": fused("ffn_gate", "ffn_up"),
        "mlp.down_proj": matrix_blocks(gguf, name("ffn_down"), config),
    }


@torch.no_grad()
def load_gguf_blocks(model, path: Path) -> None:
    """Fill an empty ``LlamaForCausalLM`` (on the CPU) from a GGUF: norms as floats, matrices as blocks."""
    from .quantized_linear import use_blocks

    gguf, config = GGUFTensors(path), model.config
    for i, layer in enumerate(model.layers):
        layer.input_layernorm.weight.copy_(gguf.floats(f"blk.{i}.attn_norm.weight"))
        layer.post_attention_layernorm.weight.copy_(gguf.floats(f"blk.{i}.ffn_norm.weight"))
    model.norm.weight.copy_(gguf.floats("output_norm.weight"))
    head = "token_embd.weight" if config.tie_word_embeddings or not gguf.has("output.weight") else "output.weight"
    if not config.tie_word_embeddings:
        model.embed_tokens.weight.copy_(gguf.blocks("token_embd.weight").dequantize())
    use_blocks(model, [layer_blocks(gguf, config, i) for i in range(config.num_layers)], gguf.blocks(head))
    model.quantization = "gguf"
