"""The story's three prompts: the ones the notebooks, ``python -m lifeofprompt demo`` and the tests follow.

One low module, so that the tokenizer's tables, the command line and the test fixtures all read
the same three texts (and nothing has to import the command line to get them).
"""

STORY_PROMPTS = ("hi my name is", "today is a beautiful summer day", "hello there")
