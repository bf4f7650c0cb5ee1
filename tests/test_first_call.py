"""The Triton specialization that explains the H200 run's one slow first token (no GPU needed)."""

from lifeofprompt.lessons.first_call import block_table_width, compile_events, int_specialization


def test_triton_makes_an_integer_one_a_constant_and_marks_multiples_of_16():
    assert [int_specialization(v) for v in (1, 2, 3, 16, 48)] == ["1", "", "", "D", "D"]


def test_block_table_width_is_the_longest_sequence_in_blocks():
    assert block_table_width([13, 31, 11]) == 2
    assert block_table_width([16]) == 1 and block_table_width([17]) == 2


def test_only_the_first_lone_prompt_that_fits_one_block_compiles_after_the_joint_warm_up():
    events = compile_events(
        [("warm-up, together", [13, 31, 11]), ("alone 1", [13]), ("alone 2", [31]), ("alone 3", [11])]
    )
    assert [e["compiles"] for e in events] == [True, True, False, False]
    assert [e["width"] for e in events] == [2, 1, 2, 1]
    # warming each prompt alone first, as benchmarks/gpu_check.py now does, leaves nothing to compile later
    warmed = compile_events([("warm", [13]), ("warm", [31]), ("warm", [11]), ("alone 1", [13])])
    assert not warmed[-1]["compiles"]
