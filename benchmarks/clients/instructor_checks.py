"""instructor against our server: ``python instructor_checks.py CHECK`` (base URL from $CLIENTS_BASE_URL).

Checks: ``parallel_tools`` (Mode.PARALLEL_TOOLS, an Iterable of two tool models: tools sent with
tool_choice "auto"), ``tools`` (Mode.TOOLS, one named tool), ``partial`` (Mode.TOOLS streamed with
create_partial; it must show the object growing, so the call's arguments must stream). Exit 0 when the
protocol worked; what the 135M model extracted is printed, not judged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import instructor
from openai import OpenAI
from pydantic import BaseModel

BASE_URL = os.environ.get("CLIENTS_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("CLIENTS_MODEL", "smollm2-135m")


class Weather(BaseModel):
    """The weather in one city."""

    city: str


class SearchQuery(BaseModel):
    """A web search."""

    query: str


class Person(BaseModel):
    name: str
    age: int


def client(mode) -> instructor.Instructor:
    return instructor.from_openai(OpenAI(base_url=BASE_URL, api_key="x", max_retries=0), mode=mode)


def parallel_tools() -> None:
    calls = client(instructor.Mode.PARALLEL_TOOLS).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What's the weather in Paris and Tokyo, and search for flights?"}],
        response_model=Iterable[Weather | SearchQuery],
        temperature=0,
        max_tokens=160,  # room for three calls, so a cut answer is not the reason a parse fails
        max_retries=1,
    )
    print("extracted:", [repr(call) for call in calls])


def tools() -> None:
    person = client(instructor.Mode.TOOLS).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Extract: Ada is 36 years old."}],
        response_model=Person,
        max_tokens=96,
        temperature=0,
        max_retries=1,
    )
    print("extracted:", repr(person))


def partial() -> None:
    stream = client(instructor.Mode.TOOLS).chat.completions.create_partial(
        model=MODEL,
        messages=[{"role": "user", "content": "Extract: Ada is 36 years old."}],
        response_model=Person,
        max_tokens=96,
        temperature=0,
        max_retries=1,
    )
    parts = list(stream)
    seen = [repr(part) for part in parts]
    print(f"{len(seen)} partial objects; first: {seen[0] if seen else None}; last: {seen[-1] if seen else None}")
    if len(set(seen)) < 2:  # the call came whole in one chunk: streaming shows no progress
        sys.exit("partial streaming showed no progress: the tool call's arguments came in one piece")
    if not isinstance(parts[-1], BaseModel):  # the streamed arguments did not concatenate to the object
        sys.exit(f"the last partial is not a Person but {type(parts[-1]).__name__}: the arguments' deltas lost text")


CHECKS = {"parallel_tools": parallel_tools, "tools": tools, "partial": partial}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
