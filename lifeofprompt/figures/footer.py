"""One line under a figure: which machine drew it and how busy it was (every measured figure has one)."""

from __future__ import annotations


def add_footer(fig, text: str, fontsize: float = 7.5):
    """Write ``text`` just below the figure's axes; returns the figure.

    The text sits below the figure's bottom edge: notebooks save figures with a tight bounding
    box (the inline backend's default), which takes it in without squeezing the axes.
    """
    fig.text(0.01, -0.005, text, ha="left", va="top", fontsize=fontsize, color="#555555")
    return fig
