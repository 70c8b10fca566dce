"""How a verl reward function is found and called; also the worker process that calls it.

Two conventions exist in verl, told apart by signature:

- a ``custom_reward_function`` takes ``(data_source, solution_str, ground_truth, extra_info)``
  (verl calls it with these keywords);
- the files of ``verl/utils/reward_score/`` take ``compute_score(solution_str, ground_truth,
  ...)`` (the first may be named otherwise, e.g. ``model_output``) and are picked by
  ``default_compute_score`` from the row's ``data_source`` (`VERL_SOURCES`).

Results are normalised as verl does: a dict gives its ``"score"``, a bool / int / float is
the score, a tuple or list gives its first element.

This file imports only the standard library: run as a script (``python verl_calls.py``) it is
the worker `VerlReward` starts, a fresh interpreter that loads the reward once and then calls
it in its main thread, so rewards built on ``signal.alarm`` (math-verify) keep their timeouts.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import signal
import struct
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "VERL_SOURCES",
    "frame",
    "load_reward",
    "normalise_score",
    "read_frame",
    "split_frames",
    "write_frame",
]

VERL_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math_reward",
    "DigitalLearningGmbH/MATH-lighteval": "math_reward",
    "HuggingFaceH4/MATH-500": "math_reward",
    "math_dapo": "math_dapo",
    "math": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    "aime*": "math_dapo",
    "numina_aops_forum": "prime_math",
    "numina_synthetic_math": "prime_math",
    "numina_amc_aime": "prime_math",
    "numina_synthetic_amc": "prime_math",
    "numina_cn_k12": "prime_math",
    "numina_olympiads": "prime_math",
    "hiyouga/geometry3k": "geo3k",
    **{
        f"searchR1_{name}": "search_r1_like_qa_em"
        for name in (
            "nq",
            "triviaqa",
            "popqa",
            "hotpotqa",
            "2wikimultihopqa",
            "musique",
            "bamboogle",
        )
    },
}
"""verl's `default_compute_score` table: data source -> reward file of `reward_score/`
(``aime*``: any source starting with "aime"). Code sources (apps, taco, ...) are left out:
verl runs their programs unsandboxed; use `CodeReward`."""

Call = Callable[[str, str, Any, dict], Any]
"""(data_source, solution_str, ground_truth, extra_info) -> the function's raw result."""


def _import_file(file: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def adapt(fn: Callable[..., Any], where: str) -> Call:
    """Calls `fn` by its signature: with verl's keywords when it takes ``data_source``, else
    as ``fn(solution_str, ground_truth)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: assume reward_score's form
        return lambda ds, sol, gt, extra: fn(sol, gt)
    if "data_source" in params:
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        names = [n for n in ("data_source", "solution_str", "ground_truth", "extra_info") if takes_any or n in params]

        def call(ds: str, sol: str, gt: Any, extra: dict) -> Any:
            given = {
                "data_source": ds,
                "solution_str": sol,
                "ground_truth": gt,
                "extra_info": extra,
            }
            return fn(**{n: given[n] for n in names})

        return call
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        raise TypeError(
            f"VerlReward: {where} takes neither (data_source, solution_str, ground_truth, "
            "extra_info) nor (solution_str, ground_truth)"
        )
    return lambda ds, sol, gt, extra: fn(sol, gt)


def load_reward(path: str, function: str = "compute_score", sources: Mapping[str, str] | None = None) -> Call:
    """The reward at `path`: a Python file holding `function`, or a folder of reward files
    (verl's ``reward_score/``) from which each sample's file is picked by its data source
    (`VERL_SOURCES`, extended or overridden by `sources`)."""
    root = Path(path)
    if root.is_file():
        module = _import_file(root, f"vapo_user_reward_{root.stem}")
        fn = getattr(module, function, None)
        if not callable(fn):
            raise AttributeError(f"VerlReward: {path} has no function {function!r}")
        return adapt(fn, f"{path}:{function}")
    if not root.is_dir():
        raise FileNotFoundError(f"VerlReward: reward file or folder {path} does not exist")
    table = {**VERL_SOURCES, **(sources or {})}
    for stem in sorted(set(table.values())):
        if not ((root / f"{stem}.py").is_file() or (root / stem / "__init__.py").is_file()):
            table = {k: v for k, v in table.items() if v != stem}  # verl's folder may lack some
    if not table:
        raise FileNotFoundError(f"VerlReward: {path} holds none of verl's reward files")
    # A package of our own over the folder: relative imports between its files work, and
    # its math_verify.py does not shadow the math_verify library.
    package = f"vapo_verl_rewards_{abs(hash(str(root.resolve())))}"
    if package not in sys.modules:
        pkg = types.ModuleType(package)
        pkg.__path__ = [str(root)]
        sys.modules[package] = pkg
    calls: dict[str, Call] = {}

    def file_for(data_source: str) -> str:
        if data_source in table:
            return table[data_source]
        for key, stem in table.items():
            if key.endswith("*") and data_source.startswith(key[:-1]):
                return stem
        raise NotImplementedError(
            f"no reward file for data_source={data_source!r} in {path}; known sources: "
            f"{', '.join(sorted(table))} (add one with sources={{{data_source!r}: 'file_stem'}})"
        )

    def call(ds: str, sol: str, gt: Any, extra: dict) -> Any:
        stem = file_for(ds)
        if stem not in calls:
            module = importlib.import_module(f"{package}.{stem}")
            calls[stem] = adapt(module.compute_score, f"{path}/{stem}.py:compute_score")
        return calls[stem](ds, sol, gt, extra)

    return call


def normalise_score(value: Any) -> float:
    """verl's reading of a reward function's result."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys: {sorted(value)})")
        value = value["score"]
    elif isinstance(value, (tuple, list)):
        value = value[0]
    if isinstance(value, bool) or hasattr(value, "__float__"):
        return float(value)
    raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")


# ---------------------------------------------------------------- framing and the worker


def frame(obj: Any) -> bytes:
    """`obj` pickled, after its length (8 bytes, little-endian)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("<Q", len(data)) + data


def split_frames(buffer: bytes) -> tuple[list[Any], bytes]:
    """The complete frames at the start of `buffer`, unpickled, and the rest."""
    out = []
    while len(buffer) >= 8:
        (size,) = struct.unpack("<Q", buffer[:8])
        if len(buffer) < 8 + size:
            break
        out.append(pickle.loads(buffer[8 : 8 + size]))
        buffer = buffer[8 + size :]
    return out, buffer


def write_frame(stream: Any, obj: Any) -> None:
    stream.write(frame(obj))
    stream.flush()


def read_frame(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def describe(err: BaseException) -> str:
    """``Type: message (at file:line)``, the line being where it was raised: a bare
    ``assert`` has no message of its own."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}" if str(err) else f"{type(err).__name__}{where}"


def serve() -> None:
    """Worker loop: frame ``(path, function, sources)``, then ``(task, data_source,
    solution_str, ground_truth, extra_info)`` frames, each answered ``(task, score, error)``
    with `error` None or ``(exception type, description)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a print() in the user's reward must not corrupt the protocol
    try:
        call = load_reward(*read_frame(requests))
    except BaseException as err:
        write_frame(replies, ("load-error", None, describe(err)))
        return
    write_frame(replies, ("ready", None, None))
    while True:
        try:
            task, ds, sol, gt, extra = read_frame(requests)
        except EOFError:
            return
        try:
            score, error = normalise_score(call(ds, sol, gt, extra)), None
        except BaseException as err:  # the user's code: any exception is this sample's error
            score, error = None, (type(err).__name__, describe(err))
        write_frame(replies, (task, score, error))


if __name__ == "__main__":
    serve()
