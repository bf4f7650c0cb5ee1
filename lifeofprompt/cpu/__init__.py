"""What exists only to make a CPU fast: the C step and kernels, their build, the calibrations, huge pages.

The model runs without any of it (``cpu_tuning="off"``); the engine reaches it through the model.
"""
