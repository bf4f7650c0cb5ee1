"""Follow calls at run time from an entry point; count the places, files and returns they pass through.

Reading the code says where a thing *could* go; this records where it *does* go on one run, so "how
scattered is it?" gets numbers a refactor can be judged by:

    python scripts/trace_calls.py settings      the serve command's settings through start-up
    python scripts/trace_calls.py first-token   LLM.generate to its first token
    ... --json PATH                             also write the numbers and the walk

A *place* is a function in a file of the package (``engine/config.py:EngineConfig.from_settings``); the
*walk* is the places called, in call order. A *stay* is a run of consecutive places in one file, a *hop*
the step between two stays, and a *return* a stay in a file the walk had already left: the reader of
the code, following the call, opens that file again.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import sys
import types

import lifeofprompt

# The settings' classes, by name, so a rename or removal in engine/config.py leaves the script working
# (a name that is gone simply never matches) instead of breaking its import.
CARRIER_CLASSES = ("EngineConfig", "ResolvedConfig")
# Frames that are part of the function around them, not places of their own.
SKIPPED_NAMES = {"<genexpr>", "<listcomp>", "<lambda>", "<dictcomp>", "<setcomp>"}
PROMPT = "hi my name is"
SUMMARIES = {  # what each mode's last line counts: start-up is read by stays, a token's path by hops
    "settings": "{stays} stays, {places} places, {files} files, {returns} returns",
    "first-token": "{hops} hops, {files} files, {places} places, {returns} returns",
}


def package_dirs() -> list[tuple[str, str]]:
    """(folder, name prefix) for the package and its kernels, which live outside it (pyproject.toml's
    package-dir): found without importing them, since importing the kernels loads Triton."""
    dirs = [(os.path.dirname(os.path.abspath(lifeofprompt.__file__)), "")]
    spec = importlib.util.find_spec("lifeofprompt.kernels")
    if spec is not None and spec.submodule_search_locations:
        kernels = os.path.abspath(list(spec.submodule_search_locations)[0])
        dirs.append((kernels, os.path.basename(kernels) + "/"))
    return dirs


def engine_field_names() -> set[str]:
    cls = getattr(importlib.import_module("lifeofprompt.engine.config"), "EngineConfig", None)
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def stays_of(walk: list[tuple[str, str]]) -> list[tuple[str, list[str], bool]]:
    """The walk cut into stays: (file, its functions in call order, whether the walk was in that file
    before: a return, since the stay before is always in another file)."""
    stays: list[tuple[str, list[str], bool]] = []
    seen: set[str] = set()
    for file, function in walk:
        if not stays or stays[-1][0] != file:
            stays.append((file, [], file in seen))
            seen.add(file)
        stays[-1][1].append(function)
    return stays


def count_walk(walk: list[tuple[str, str]]) -> dict:
    """The walk's numbers: stays, hops between them, distinct places and files, and returns."""
    stays = stays_of(walk)
    return {
        "stays": len(stays),
        "hops": max(len(stays) - 1, 0),
        "places": len(set(walk)),
        "files": len({file for file, _ in walk}),
        "returns": sum(back for _, _, back in stays),
    }


class Carriers:
    """Says whether a value carries the engine's settings. The dataclass values a carrier holds (a frozen
    sub-config such as ``ResolvedConfig.scheduler``) count too, from the moment the carrier is seen."""

    def __init__(self, field_names: set[str]):
        self.field_names = field_names
        self.held: dict[int, object] = {}  # id -> value, kept alive so an id is never reused meanwhile

    def is_direct(self, value) -> bool:
        if isinstance(value, argparse.Namespace) or type(value).__name__ in CARRIER_CLASSES:
            return True
        return isinstance(value, dict) and bool(value) and all(key in self.field_names for key in value)

    def check(self, value) -> bool:
        """Whether ``value`` is a carrier; a direct one's dataclass values are remembered as carriers."""
        if id(value) in self.held:
            return True
        if not self.is_direct(value):
            return False
        for inner in value.values() if isinstance(value, dict) else getattr(value, "__dict__", {}).values():
            if dataclasses.is_dataclass(inner) and not isinstance(inner, type):
                self.held[id(inner)] = inner
        return True


def arguments(frame, with_self: bool = False) -> list:
    """The values a call got, read from its frame as it starts: named ones (``self``/``cls`` only
    ``with_self``) and what ``*args`` and ``**kwargs`` hold, besides those containers themselves."""
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    star = code.co_varnames[count] if code.co_flags & inspect.CO_VARARGS else None
    count += bool(star)
    double = code.co_varnames[count] if code.co_flags & inspect.CO_VARKEYWORDS else None
    skipped = () if with_self else ("self", "cls")
    names = [name for name in code.co_varnames[: count + bool(double)] if name not in skipped]
    values = [local[name] for name in names if name in local]
    values += list(local.get(star, ())) if star else []
    values += list(local.get(double, {}).values()) if double else []
    return values


@functools.cache
def slot_members(cls: type) -> tuple:
    """The ``__slots__`` members of a class and its bases (a slotted dataclass's fields among them)."""
    slotted = [c for c in cls.__mro__ if "__slots__" in vars(c)]
    return tuple(m for c in slotted for m in vars(c).values() if isinstance(m, types.MemberDescriptorType))


def held_values(value) -> list:
    """What an object holds one level down: its ``__dict__`` values and its slots, read without running
    its code (no property is called). A torch module's parameters and buffers sit in dicts of their own
    inside ``__dict__``: those dicts are looked at, never walked into."""
    if isinstance(value, type):
        return []
    held = list(attributes.values()) if isinstance(attributes := getattr(value, "__dict__", None), dict) else []
    for member in slot_members(type(value)):
        try:
            held.append(member.__get__(value))
        except AttributeError:  # a slot never set
            pass
    return held


def settings_in_reach(frame, carriers: Carriers) -> bool:
    """Whether the settings are in reach of a call: passed to it (an argument other than ``self`` is a
    carrier), or held by what it got (an argument, ``self`` included, has a carrier as an attribute).
    Most of start-up reads the settings from ``self.config``/``self.resolved`` or from an object holding
    them, never getting them as an argument; the first rule alone misses those places."""
    if any(map(carriers.check, arguments(frame))):
        return True
    return any(carriers.check(held) for value in arguments(frame, with_self=True) for held in held_values(value))


class Tracer:
    """A ``sys.setprofile`` hook that records every call into the package that ``wanted(frame)`` accepts;
    with ``carriers``, settings returned by a package function are noted too (``resolve`` returns the
    ``ResolvedConfig`` whose ``scheduler`` is passed on before the config itself ever is)."""

    def __init__(self, wanted=None, carriers: Carriers | None = None):
        self.dirs, self.wanted, self.carriers = package_dirs(), wanted, carriers
        self.walk: list[tuple[str, str]] = []
        self._places: dict[object, tuple[str, str] | None] = {}  # code object -> place (None: not ours)

    def place(self, code) -> tuple[str, str] | None:
        """``(file, qualified name)`` of a package function, else None (generated code has no real file)."""
        if code not in self._places:
            path = os.path.abspath(code.co_filename)
            files = [prefix + os.path.relpath(path, d) for d, prefix in self.dirs if path.startswith(d + os.sep)]
            ours = files and code.co_name not in SKIPPED_NAMES and os.path.isfile(path)
            self._places[code] = (files[0], getattr(code, "co_qualname", code.co_name)) if ours else None
        return self._places[code]

    def __call__(self, frame, event, arg):
        if event not in ("call", "return") or (place := self.place(frame.f_code)) is None:
            return
        if event == "call" and (self.wanted is None or self.wanted(frame)):
            self.walk.append(place)
        elif event == "return" and self.carriers is not None:
            self.carriers.check(arg)

    def __enter__(self) -> Tracer:
        self._previous = sys.getprofile()
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)


def settings_walk() -> list[tuple[str, str]]:
    """``serve``'s start-up with default flags, up to (not including) the HTTP server."""
    from lifeofprompt import cli, commands
    from lifeofprompt.serving.auth import api_key_from
    from lifeofprompt.serving.limits import ServerLimits
    from lifeofprompt.serving.server import ServerConfig

    args = cli.build_parser().parse_args(["serve"])
    # Once untraced in a child first: a cold start-up would time the CPU's paths under the profiler (slowed
    # per call) and cache those choices for every later run; the traced walk is then a warm-cache start-up.
    child = multiprocessing.get_context("spawn").Process(target=commands._engine_for_serving, args=(args,))
    child.start()
    child.join()
    carriers = Carriers(engine_field_names())
    with Tracer(lambda frame: settings_in_reach(frame, carriers), carriers) as tracer:
        big = args.max_request_bytes
        limits = ServerLimits() if big is None else ServerLimits(max_request_bytes=big)
        ServerConfig(
            api_key=api_key_from(args.api_key),
            enable_docs=args.enable_docs,
            allowed_origins=args.allowed_origins,
            limits=limits,
            shutdown_timeout=args.shutdown_timeout,
        )
        engine = commands._engine_for_serving(args)
    engine.shutdown()
    return tracer.walk


def first_token_walk() -> list[tuple[str, str]]:
    """``LLM.generate`` of one prompt and one token; the engine is built before the trace starts."""
    from lifeofprompt.engine.llm import LLM
    from lifeofprompt.engine.sampling_params import SamplingParams

    llm = LLM(**({"log_stats": False} if "log_stats" in engine_field_names() else {}))
    params = SamplingParams(temperature=0, max_tokens=1)
    with Tracer() as tracer:
        llm.generate([PROMPT], params, use_tqdm=False)
    llm.shutdown()
    return tracer.walk


def functions_text(functions: list[str]) -> str:
    """A stay's functions in first-call order, a repeated one with its count."""
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in collections.Counter(functions).items())


def report(mode: str, walk: list[tuple[str, str]]) -> dict:
    """Print the table of stays and the summary line; return what --json writes."""
    stays, counts = stays_of(walk), count_walk(walk)
    width = max((len(file) for file, _, _ in stays), default=4)
    print(f"{'stay':>4}  {'file':<{width}}  {'':6}  functions")
    for number, (file, functions, back) in enumerate(stays, 1):
        print(f"{number:>4}  {file:<{width}}  {'RETURN' if back else '':6}  {functions_text(functions)}")
    print(f"{mode}: {SUMMARIES[mode].format(**counts)}")
    stay_rows = [{"file": file, "functions": functions, "return": back} for file, functions, back in stays]
    return {"mode": mode, "counts": counts, "walk": [list(place) for place in walk], "stays": stay_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=tuple(SUMMARIES))
    parser.add_argument("--json", metavar="PATH", help="write the numbers, the walk and its stays here")
    args = parser.parse_args(argv)
    walk = settings_walk() if args.mode == "settings" else first_token_walk()
    result = report(args.mode, walk)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
