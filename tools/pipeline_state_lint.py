"""A CPU check of one CuTe DSL pitfall: a pipeline state advanced inside a helper.

In a CuTe DSL kernel, a ``@cute.jit`` helper that advances a pipeline state it was given
(``state.advance()``) inside dynamic control flow rebinds its own variable to the advanced
state; the caller's object is not advanced. A caller that goes on using that state after the
call then restarts from the old slot and phase: on the GPU, a ring that waits for a slot
nobody will release (a hang) or barriers re-armed out of phase (a launch failure); the
tiled kernel's first persistent run did both. The fix is to return the state and rebind it
(``fill = self._prologue(..., fill, ...)``).

This check reads a module's source (no compile): for every class, each ``@cute.jit`` or
``@cute.kernel`` method that calls ``p.advance()`` on one of its parameters ``p`` without
returning ``p`` is an *advancing helper*; a call ``self.helper(..., v, ...)`` that passes a
name ``v`` in such a position, in a method that uses ``v`` again after the call (not in the
other branch of an ``if`` around the call), is a finding. It sees direct ``self.`` calls and
plain names only::

    python tools/pipeline_state_lint.py fast/gemm/tiled_kernel.py ...   # prints findings
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["findings", "main"]

_DECORATORS = ("cute.jit", "cute.kernel")


def _jit_methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)
            and any(ast.unparse(d) in _DECORATORS for d in f.decorator_list)}


def _advanced_unreturned(f: ast.FunctionDef) -> dict[int, str]:
    """{position among the call's arguments: parameter} of the parameters ``f`` advances
    and does not return."""
    params = [a.arg for a in f.args.args[1:]]  # after self
    advanced = {n.func.value.id for n in ast.walk(f)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "advance" and isinstance(n.func.value, ast.Name)
                and n.func.value.id in params}
    returned = {x.id for n in ast.walk(f) if isinstance(n, ast.Return) and n.value is not None
                for x in ast.walk(n.value) if isinstance(x, ast.Name)}
    return {params.index(p): p for p in advanced - returned}


def _branches(root: ast.AST, target: ast.AST) -> list[tuple[ast.If, str]] | None:
    """The ``(if statement, "body" | "orelse")`` pairs on the way from ``root`` to ``target``."""
    if root is target:
        return []
    for field, children in ast.iter_fields(root):
        kids = children if isinstance(children, list) else [children]
        for child in kids:
            if not isinstance(child, ast.AST):
                continue
            got = _branches(child, target)
            if got is not None:
                step = [(root, field)] if isinstance(root, ast.If) and field in ("body", "orelse") \
                    else []
                return step + got
    return None


def _in_other_branch(root: ast.AST, a: ast.AST, b: ast.AST) -> bool:
    where_a = {id(node): field for node, field in _branches(root, a) or []}
    return any(id(node) in where_a and where_a[id(node)] != field
               for node, field in _branches(root, b) or [])


def findings(source: str, path: str = "<source>") -> list[str]:
    """The findings of the module ``source`` (one line each, ``path:line: ...``)."""
    out = []
    for cls in (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)):
        methods = _jit_methods(cls)
        helpers = {name: _advanced_unreturned(f) for name, f in methods.items()}
        for caller in methods.values():
            for call in ast.walk(caller):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
                        and helpers.get(call.func.attr)):
                    continue
                for at, param in helpers[call.func.attr].items():
                    if at >= len(call.args) or not isinstance(call.args[at], ast.Name):
                        continue
                    name = call.args[at].id
                    later = sorted(n.lineno for n in ast.walk(caller)
                                   if isinstance(n, ast.Name) and n.id == name
                                   and n.lineno > call.end_lineno
                                   and not _in_other_branch(caller, call, n))
                    if later:
                        out.append(f"{path}:{call.lineno}: {caller.name} passes {name} to "
                                   f"{call.func.attr}, which advances it ({param}) without "
                                   f"returning it, and uses {name} again at line {later[0]}")
    return out


def main(argv=None) -> int:
    """Print the findings of each file named; exit status 1 when there are any."""
    found = [line for p in (sys.argv[1:] if argv is None else argv)
             for line in findings(Path(p).read_text(), p)]
    print("\n".join(found) or "no findings")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
