"""The VRAM land as a picture and as a panel of sliders (notebook 05).

``land_figure(plan)`` draws one stacked bar: what the utilization fraction leaves out, the
weights, the activation workspace, the KV pool. ``land_report(plan, context_len)`` is the text
vLLM users know from the start-up log (GPU blocks, CPU blocks) plus how many requests of a given
length fit. ``update_land(...)`` turns slider values into the plan (``land_plan``) and both, as a plain
function, so tests call it directly; ``memory_panel()`` wires it to ipywidgets.
"""

from __future__ import annotations

from ..engine.memory import MemoryPlan, plan_memory
from ..errors import LifeOfPromptError
from ..lessons.memory_arithmetic import LLAMA_3_1_8B, cpu_blocks, kv_tokens, max_concurrency, unusable
from ..lessons.story_model import SMOLLM2_135M
from ..model.config import TINYLLAMA_1_1B
from ..units import GiB, format_bytes

KNOWN_CONFIGS = {  # the models the panel offers
    "tinyllama-1.1b": TINYLLAMA_1_1B,
    "smollm2-135m": SMOLLM2_135M,
    "llama-3.1-8b": LLAMA_3_1_8B,
}
LAND_COLORS = {"unusable": "#d9d9d9", "weights": "#4c72b0", "activations": "#dd8452", "KV pool": "#55a868"}


def land_figure(plan: MemoryPlan, title: str = "", ax=None):
    """One horizontal bar of the device's memory, split among its tenants, sizes in GiB."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.0))
    act_label = "activations (measured)" if plan.activations_measured else "activations (estimated)"
    parts = [
        ("weights", plan.weights, "weights"),
        (act_label, plan.activations, "activations"),
        ("KV pool", plan.kv_pool, "KV pool"),
        ("not used (1 − utilization)", unusable(plan), "unusable"),
    ]
    left = 0.0
    for label, nbytes, color_key in parts:
        width = nbytes / GiB
        ax.barh(
            [0],
            [width],
            left=left,
            color=LAND_COLORS[color_key],
            edgecolor="white",
            label=f"{label}: {format_bytes(nbytes)}",
        )
        if width > 0.06 * plan.total / GiB:
            ax.text(left + width / 2, 0, format_bytes(nbytes), ha="center", va="center", fontsize=9)
        left += width
    ax.set_xlim(0, plan.total / GiB)
    ax.set_yticks([])
    ax.set_xlabel("GiB of device memory", labelpad=2)
    ax.set_title(title or f"The land: {format_bytes(plan.total)} device, {plan.num_gpu_blocks:,} GPU blocks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=2, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax.figure


def land_report(plan: MemoryPlan, context_len: int) -> str:
    """The plan in words and the numbers a server log shows."""
    act = "measured" if plan.activations_measured else "estimated"
    return "\n".join(
        [
            f"device memory      {format_bytes(plan.total)}  (usable {format_bytes(plan.usable)})",
            f"weights            {format_bytes(plan.weights)}",
            f"activations        {format_bytes(plan.activations)} ({act})",
            f"KV pool            {format_bytes(plan.kv_pool)}",
            f"bytes per block    {plan.bytes_per_block:,} ({plan.block_size} tokens × {plan.bytes_per_token:,} bytes)",
            f"GPU blocks         {plan.num_gpu_blocks:,}  ({kv_tokens(plan):,} tokens)",
            f"CPU blocks         {cpu_blocks(plan):,}",
            f"requests of {context_len:,} tokens that fit at once: {max_concurrency(plan, context_len):,}",
        ]
    )


def land_plan(gpu_memory_gib: float, utilization: float, model: str, block_size: int, dtype="bf16") -> MemoryPlan:
    """Slider values → the plan that the figure and the report draw (raises where the setting cannot work)."""
    return plan_memory(KNOWN_CONFIGS[model], dtype, int(gpu_memory_gib * GiB), utilization, block_size)


def update_land(gpu_memory_gib: float, utilization: float, model: str, block_size: int, context_len: int, dtype="bf16"):
    """Slider values → ``(figure or None, text, plan or None)``: the land of ``model`` on a device reporting
    ``gpu_memory_gib`` GiB.

    A setting that cannot work (the model does not fit, a block size of 0) gives ``None`` and the
    error's message, so the panel explains instead of crashing.
    """
    import matplotlib.pyplot as plt

    try:
        plan = land_plan(gpu_memory_gib, utilization, model, block_size, dtype)
    except LifeOfPromptError as exc:
        return None, f"{type(exc).__name__}: {exc}", None
    title = f"{KNOWN_CONFIGS[model].name} ({dtype}) on {gpu_memory_gib:g} GiB at {utilization:.0%}"
    fig = land_figure(plan, title=title)
    plt.close(fig)  # shown by the caller, not by pyplot's auto-display
    return fig, land_report(plan, context_len), plan


def memory_panel(
    gpu_memory_gib: float = 16.0,
    utilization: float = 0.9,
    model: str = "tinyllama-1.1b",
    block_size: int = 16,
    context_len: int = 4096,
):
    """Sliders for GPU memory, utilization, model, block size and context length over the land."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = dict(
        gpu_memory_gib=widgets.FloatSlider(
            value=gpu_memory_gib, min=2, max=192, step=1, description="GPU GiB", continuous_update=False
        ),
        utilization=widgets.FloatSlider(
            value=utilization, min=0.05, max=1.0, step=0.01, description="utilization", continuous_update=False
        ),
        model=widgets.Dropdown(options=list(KNOWN_CONFIGS), value=model, description="model"),
        block_size=widgets.Dropdown(options=[8, 16, 32, 64, 128], value=block_size, description="block size"),
        context_len=widgets.IntSlider(
            value=context_len, min=16, max=32768, step=16, description="context", continuous_update=False
        ),
    )
    out = widgets.Output()
    shown = {}  # the latest text and plan, readable without a browser

    def redraw(_=None):
        fig, text, plan = update_land(**{name: w.value for name, w in controls.items()})
        shown.update(text=text, plan=plan)
        out.clear_output(wait=True)
        with out:
            print(text)
            if fig is not None:
                display(fig)

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    panel = widgets.VBox(
        [
            widgets.HBox([controls["gpu_memory_gib"], controls["utilization"]]),
            widgets.HBox([controls["model"], controls["block_size"], controls["context_len"]]),
            out,
        ]
    )
    panel.controls = controls  # for tests and for readers who want to set values in code
    panel.shown = shown
    return panel


def bytes_per_weight_figure(steps, footer: str = ""):
    """Chapter 06: for each way of holding the weights, the batch-1 step's floor (bytes ÷ read rate) and the
    step measured, side by side, in milliseconds; each pair labelled with its bits per weight."""
    import matplotlib.pyplot as plt

    from .footer import add_footer

    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = range(len(steps))
    floors = [s.floor_s * 1e3 for s in steps]
    measured = [s.step_s * 1e3 for s in steps]
    ax.bar(
        [i - 0.2 for i in x], floors, width=0.4, color="#c6d3e6", edgecolor="#4c72b0", label="floor: bytes ÷ read rate"
    )
    ax.bar([i + 0.2 for i in x], measured, width=0.4, color="#4c72b0", label="batch-1 step, measured")
    for i in x:
        ax.text(i + 0.2, measured[i], f"{measured[i]:.1f}", ha="center", va="bottom", fontsize=8)
        ax.text(i - 0.2, floors[i], f"{floors[i]:.1f}", ha="center", va="bottom", fontsize=8, color="#4c72b0")
    ax.set_xticks(list(x), [f"{s.label}\n{s.bits_per_weight:.1f} bits/weight" for s in steps], fontsize=8.5)
    ax.set_ylabel("milliseconds per token")
    ax.set_title("Fewer bytes per weight: the floor falls with the bytes; the step follows as far as unpacking allows")
    ax.legend(frameon=False, fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    if footer:
        add_footer(fig, footer)
    fig.tight_layout()
    return fig
