"""Tools over HTTP, the answer's side: Hermes-format calls parsed out of the text, whole or as stream deltas.

The grammar (``tools.tool_structure``) writes every call as ``<tool_call>\\n{"name": "f", "arguments": ``,
the arguments' JSON, then ``}\\n</tool_call>``. ``ToolCallParser`` reads that back as the text
arrives, piece by piece, and says what can be sent so far:

* text outside the calls is ``content``, except a tail that could still be the start of the
  trigger (``<tool_c`` is held back until the next piece shows what it was);
* a call opens once its name is complete: its first delta carries ``index``, ``id``, ``type`` and
  ``function.name`` with empty ``arguments``;
* the arguments follow as they are generated, except a tail that could be the start of the closing
  ``}\\n</tool_call>``. Concatenated, the pieces are exactly the arguments' JSON text: a raw newline
  cannot occur inside a JSON string nor ``<`` outside one, so the first ``}\\n</tool_call>`` is the close.

A whole answer is the same parser fed the whole text (``message_from``), so streamed and whole
answers agree. An answer with a call is ``finish_reason: "tool_calls"``, its text outside the calls
the ``content`` (null if only whitespace). An answer cut by ``max_tokens`` inside a call keeps
``"length"``: the complete calls come back, and the cut one with its arguments as far as they got (not
valid JSON; streamed, they were already sent). What a cut leaves of the framing is never content: with
``tool_choice`` "required" or a named function (``text_allowed=False``) nothing outside the calls is, and
in "auto" a trailing start of another trigger after a call (``\n<tool``) is dropped; in "auto" a cut
before the first call's name was complete stays content (it may have been text).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .tools import ARGUMENTS_OPEN, CALL_CLOSE, CALL_OPEN, TRIGGER


def _held_tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (so must wait)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ParsedPiece:
    """What one piece of text added: content, calls opened (index, id, name), argument pieces (index, text)."""

    content: str = ""
    opened: list[tuple[int, str, str]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)


class ToolCallParser:
    """One answer's text → content and calls, incrementally. ``feed`` each piece, ``finish`` at the end."""

    def __init__(self, text_allowed: bool = True):
        self.text_allowed = text_allowed  # False for "required" and a named function: the grammar writes only calls
        self.state = "text"  # "text", "opening" (name not complete yet) or "arguments"
        self.buffer = ""  # text received but not yet given out
        self.num_calls = 0
        self.closed_calls = 0
        self.stretch_has_text = False  # has content other than whitespace been given out since the last call?

    def feed(self, text: str, final: bool = False) -> ParsedPiece:
        piece, self.buffer = ParsedPiece(), self.buffer + text
        while self._step(piece, final):
            pass
        return piece

    def _step(self, piece: ParsedPiece, final: bool) -> bool:
        """Move past what the buffer settles; True if the state changed (look again)."""
        if self.state == "text":
            start = self.buffer.find(TRIGGER)
            if start < 0:
                keep = _held_tail(self.buffer, TRIGGER)
                self._text(piece, len(self.buffer) - (keep if not final or self.num_calls else 0), final=final)
                if final:  # a cut after a call, inside the next trigger: framing, not content
                    self.buffer = ""
                return False
            self._text(piece, start, before_call=True)
            self.state = "opening"
            return True
        if self.state == "opening":
            name_end = self.buffer.find(ARGUMENTS_OPEN, len(CALL_OPEN))
            if not self.buffer.startswith(CALL_OPEN[: len(self.buffer)]):  # not our format (no grammar): text
                piece.content += self.buffer[: len(TRIGGER)]
                self.buffer, self.state = self.buffer[len(TRIGGER) :], "text"
                return True
            if name_end < 0:
                if final:  # cut before the name was complete: text where text may be written
                    piece.content += self.buffer if self.text_allowed else ""
                    self.buffer = ""
                return False
            name = self.buffer[len(CALL_OPEN) : name_end]
            piece.opened.append((self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name))
            self.buffer, self.state = self.buffer[name_end + len(ARGUMENTS_OPEN) :], "arguments"
            self.num_calls += 1
            return True
        index, end = self.num_calls - 1, self.buffer.find(CALL_CLOSE)
        if end < 0:
            keep = 0 if final else _held_tail(self.buffer, CALL_CLOSE)
            self._arguments(piece, index, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._arguments(piece, index, self.buffer[:end])
        self.buffer, self.state = self.buffer[end + len(CALL_CLOSE) :], "text"
        self.closed_calls += 1
        self.stretch_has_text = False
        return True

    def _text(self, piece: ParsedPiece, size: int, final: bool = False, before_call: bool = False) -> None:
        """Give out the buffer's first ``size`` characters as content. A stretch between calls (or before the first,
        after the last) that is only whitespace is held, and dropped at the call or the end: the newline
        between two calls is not content (a whole answer's ``content`` is then null)."""
        text = self.buffer[:size]
        if not self.text_allowed:  # only separators (and cut framing) can stand outside the calls
            self.buffer = self.buffer[size:]
            return
        if text.strip() or self.stretch_has_text or (final and not self.num_calls):
            piece.content += text
            self.stretch_has_text = self.stretch_has_text or bool(text.strip())
        elif not (before_call or final):
            return  # only whitespace so far: wait
        self.buffer = self.buffer[size:]

    @staticmethod
    def _arguments(piece: ParsedPiece, index: int, text: str) -> None:
        if text:
            piece.arguments.append((index, text))

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """ "tool_calls" for an answer that stopped after its calls; the engine's reason otherwise."""
        if engine_reason == "stop" and self.num_calls and self.closed_calls == self.num_calls:
            return "tool_calls"
        return engine_reason


def message_from(text: str, engine_reason: str | None, text_allowed: bool = True) -> tuple[dict, str | None]:
    """A whole answer as OpenAI's assistant message fields (``content``, ``tool_calls``) and finish reason."""
    parser = ToolCallParser(text_allowed)
    piece = parser.feed(text, final=True)
    if not piece.opened:
        return {"content": piece.content if text_allowed else None}, engine_reason
    arguments = ["" for _ in piece.opened]
    for index, part in piece.arguments:
        arguments[index] += part
    calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments[index]}}
        for index, call_id, name in piece.opened
    ]
    return {"content": piece.content or None, "tool_calls": calls}, parser.finish_reason(engine_reason)


def deltas_from(piece: ParsedPiece) -> list[dict]:
    """One piece as stream deltas (usually one): ``content`` and ``tool_calls``, one entry per call ``index``
    in a delta, as vLLM sends them (a client reading ``tool_calls[0]`` of each chunk would lose a second entry
    of the same call). A call opened by this piece gets a delta of its own with its name and empty
    ``arguments``, before the delta with its first arguments: the name always comes first."""
    opened = {index for index, _, _ in piece.opened}
    first: dict = {"content": piece.content} if piece.content else {}
    calls = {index: _arguments_entry(index) for index, _ in piece.arguments if index not in opened}
    for index, call_id, name in piece.opened:
        calls[index] = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    later = {index: _arguments_entry(index) for index, _ in piece.arguments if index in opened}
    for index, text in piece.arguments:
        (later if index in opened else calls)[index]["function"]["arguments"] += text
    if calls:
        first["tool_calls"] = [calls[index] for index in sorted(calls)]
    deltas = [first]
    if later:
        deltas.append({"tool_calls": [later[index] for index in sorted(later)]})
    return deltas


def _arguments_entry(index: int) -> dict:
    return {"index": index, "function": {"arguments": ""}}
