"""The embedded model's stored bytes, read from its GGUF, and the decode floors they imply."""

import pytest

from lifeofprompt.lessons.quantization import StoredWeights, decode_floors, gguf_bytes
from lifeofprompt.lessons.story_model import SMOLLM2_135M


def test_embedded_gguf_is_mostly_4_bit():
    stored = gguf_bytes()
    assert set(stored.bytes_by_type) == {"Q4_1", "Q8_0", "F32"}
    assert stored.bits_per_weight("Q4_1") == 5.0  # 4-bit values + an fp16 scale and minimum per 32
    assert stored.bits_per_weight("Q8_0") == 8.5  # the (tied) embedding table
    assert stored.bits_per_weight("F32") == 32.0  # the norms
    assert stored.num_weights == 134_515_008  # every weight of SmolLM2-135M, the table once
    assert stored.total_bytes < stored.num_weights  # under one byte a weight


def test_floors_scale_with_bytes():
    stored = StoredWeights({"Q4_1": 50, "F32": 40}, {"Q4_1": 80, "F32": 10})
    floors = decode_floors(stored, read_bandwidth=10.0)
    assert [f.weight_bytes for f in floors] == [90, 180, 360]
    assert [f.floor_s for f in floors] == pytest.approx([9.0, 18.0, 36.0])
    assert SMOLLM2_135M.tie_word_embeddings  # why the whole table counts: the LM head reads it


def test_the_bytes_per_weight_figure_pairs_each_floor_with_its_step():
    import matplotlib

    matplotlib.use("Agg")
    from lifeofprompt.figures.memory import bytes_per_weight_figure
    from lifeofprompt.lessons.quantization import FormatStep

    steps = [
        FormatStep("fp32", 538_000_000, 0.018, 0.020, "C step", 29.5),
        FormatStep("Q4_1", 84_000_000, 0.003, 0.006, "C step", 31.3),
    ]
    ax = bytes_per_weight_figure(steps, footer="a machine").axes[0]
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == [3.0, 6.0, 18.0, 20.0]  # two floors and two steps, in milliseconds
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0].startswith("fp32\n32.0 bits") and labels[1].startswith("Q4_1\n5.0 bits")
