"""langchain-openai against our server: ``python langchain_checks.py CHECK`` (base URL from $CLIENTS_BASE_URL).

Checks: ``invoke`` and ``stream`` (plain chat), ``bind_tools`` (ChatOpenAI.bind_tools(...).invoke: tools
with no tool_choice, so "auto"), ``responses_api`` (ChatOpenAI(use_responses_api=True)). Exit 0 when the
protocol worked; what the 135M model answered is printed, not judged.
"""

from __future__ import annotations

import os
import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

BASE_URL = os.environ.get("CLIENTS_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("CLIENTS_MODEL", "smollm2-135m")


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "sunny"


def chat(max_tokens: int = 32, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=BASE_URL, api_key="x", max_tokens=max_tokens, temperature=0, max_retries=0, **kwargs
    )


def invoke() -> None:
    print("content:", repr(chat().invoke("Say hello in one word.").content))


def stream() -> None:
    parts = [chunk.content for chunk in chat().stream("Count to three.")]
    print(f"{len(parts)} chunks:", repr("".join(str(p) for p in parts)))


def bind_tools() -> None:
    message = chat(max_tokens=96).bind_tools([get_weather]).invoke("What's the weather in Paris?")
    print("content:", repr(message.content), "| tool_calls:", message.tool_calls)


def responses_api() -> None:
    message = chat(use_responses_api=True).invoke("Say hello in one word.")
    print("content:", repr(message.content))


CHECKS = {"invoke": invoke, "stream": stream, "bind_tools": bind_tools, "responses_api": responses_api}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
