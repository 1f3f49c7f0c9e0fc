"""The mutants of one Python source file, as text edits that keep every line where it was (so a
mutant's line still names the tests that reach it). Pure: source in, mutants out.

Operators: comparison boundaries and swaps (`<` -> `<=`, `==` -> `!=`, `in` -> `not in`),
arithmetic and bitwise swaps, `and` <-> `or`, a dropped `not` or unary minus, integer and float
constants off by one, `True` <-> `False`, negated `if`/`while` conditions, `return X` ->
`return None`, and removed statements (`raise`, calls, attribute and item assignments,
`break`/`continue`) replaced by `pass`. Docstrings, annotations, decorators, strings and
logging calls are left alone: mutating them says nothing about the promises under test.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE_SWAPS: dict[type[ast.cmpop], list[type[ast.cmpop]]] = {
    ast.Lt: [ast.LtE],
    ast.LtE: [ast.Lt],
    ast.Gt: [ast.GtE],
    ast.GtE: [ast.Gt],
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
_BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_LOGGERS = {"log", "logger", "_log", "_logger", "LOG", "LOGGER", "warnings"}


@dataclass(frozen=True)
class Mutant:
    """Replace source bytes [start, end) with `replacement`; lines `line`..`end_line`."""

    line: int
    end_line: int
    description: str
    start: int
    end: int
    replacement: bytes

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement + source[self.end :]


def mutants(source: bytes) -> list[Mutant]:
    """Every mutant of `source` that still compiles, in source order."""
    tree = ast.parse(source)
    found = _Finder(source).collect(tree)
    valid = []
    for mutant in sorted(found, key=lambda m: (m.start, m.end, m.description)):
        try:
            compile(mutant.apply(source), "<mutant>", "exec", dont_inherit=True)
        except SyntaxError:
            continue
        valid.append(mutant)
    return valid


def _op_symbol(op: ast.AST) -> str:
    """`<=`, `not in`, `+`: the operator as source spells it."""
    probe: ast.expr
    if isinstance(op, ast.cmpop):
        probe = ast.Compare(ast.Name("a"), [op], [ast.Name("b")])
    elif isinstance(op, ast.boolop):
        probe = ast.BoolOp(op, [ast.Name("a"), ast.Name("b")])
    else:
        assert isinstance(op, ast.operator)
        probe = ast.BinOp(ast.Name("a"), op, ast.Name("b"))
    return ast.unparse(probe)[2:-2]


class _Finder:
    def __init__(self, source: bytes) -> None:
        self.source = source
        self.line_starts = [0]
        for index, byte in enumerate(source):
            if byte == 0x0A:
                self.line_starts.append(index + 1)
        self.found: list[Mutant] = []

    def collect(self, tree: ast.Module) -> list[Mutant]:
        for node in self._walk(tree):
            self._visit(node)
        return self.found

    def _walk(self, node: ast.AST) -> Iterator[ast.AST]:
        """Every node but the ones that carry no behaviour under test."""
        if self._skipped(node):
            return
        yield node
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            children = value if isinstance(value, list) else [value]
            for child in children:
                if isinstance(child, ast.AST):
                    yield from self._walk(child)

    @staticmethod
    def _skipped(node: ast.AST) -> bool:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return True  # docstrings
        if isinstance(node, ast.Expr) and _is_logging(node.value):
            return True
        if isinstance(node, ast.JoinedStr):
            return True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
        return isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )

    def _offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def _add(self, node: ast.AST, description: str, text: str, wrap: bool = True) -> None:
        """Replace `node` with `text`, padded to the number of lines it spanned."""
        line, end_line = node.lineno, node.end_lineno  # type: ignore[attr-defined]
        assert end_line is not None
        start = self._offset(line, node.col_offset)  # type: ignore[attr-defined]
        end = self._offset(end_line, node.end_col_offset)  # type: ignore[attr-defined]
        pad = "\n" * max(0, end_line - line - text.count("\n"))
        replacement = f"({text}{pad})" if wrap else f"{text}{pad}"
        self.found.append(Mutant(line, end_line, description, start, end, replacement.encode()))

    def _segment(self, node: ast.AST) -> str:
        start = self._offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self._offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return self.source[start:end].decode()

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.Compare):
            for index, op in enumerate(node.ops):
                for swap in _COMPARE_SWAPS.get(type(op), []):
                    changed = copy.deepcopy(node)
                    changed.ops[index] = swap()
                    what = f"`{_op_symbol(op)}` -> `{_op_symbol(swap())}`"
                    self._add(node, what, ast.unparse(changed))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            if not (_is_text(node.left) or _is_text(node.right)):
                swapped = _BINOP_SWAPS[type(node.op)]()
                changed_bin = copy.deepcopy(node)
                changed_bin.op = swapped
                what = f"`{_op_symbol(node.op)}` -> `{_op_symbol(swapped)}`"
                self._add(node, what, ast.unparse(changed_bin))
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAPS:
            swapped = _BINOP_SWAPS[type(node.op)]()
            changed_aug = copy.deepcopy(node)
            changed_aug.op = swapped
            what = f"`{_op_symbol(node.op)}=` -> `{_op_symbol(swapped)}=`"
            self._add(node, what, ast.unparse(changed_aug), wrap=False)
            self._add(node, "statement removed", "pass", wrap=False)
        elif isinstance(node, ast.BoolOp):
            swapped_bool: ast.boolop = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            changed_bool = copy.deepcopy(node)
            changed_bool.op = swapped_bool
            what = f"`{_op_symbol(node.op)}` -> `{_op_symbol(swapped_bool)}`"
            self._add(node, what, ast.unparse(changed_bool))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
            symbol = "not" if isinstance(node.op, ast.Not) else "-"
            self._add(node, f"`{symbol}` dropped", self._segment(node.operand))
        elif isinstance(node, ast.Constant):
            self._constant(node)
        elif isinstance(node, ast.If | ast.While | ast.IfExp):
            what = "condition negated"
            self._add(node.test, what, f"not ({self._segment(node.test)})")
        if isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                self._add(node, "`return X` -> `return None`", "return None", wrap=False)
        elif isinstance(node, ast.Raise | ast.Break | ast.Continue):
            self._add(node, f"`{self._segment(node).split()[0]}` removed", "pass", wrap=False)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call | ast.Await):
            self._add(node, "call removed", "pass", wrap=False)
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Attribute | ast.Subscript) for t in node.targets
        ):
            self._add(node, "assignment removed", "pass", wrap=False)

    def _constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self._add(node, f"`{value}` -> `{not value}`", repr(not value))
        elif isinstance(value, int):
            self._add(node, f"`{value}` -> `{value + 1}`", repr(value + 1))
            if value != 0:
                self._add(node, f"`{value}` -> `{value - 1}`", repr(value - 1))
        elif isinstance(value, float):
            self._add(node, f"`{value!r}` -> `{value + 1.0!r}`", repr(value + 1.0))


def _is_text(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
    )


def _is_logging(node: ast.expr) -> bool:
    """`log.info(...)`, `self._log.debug(...)`, `warnings.warn(...)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner = node.func.value
    if isinstance(owner, ast.Attribute):
        return owner.attr in _LOGGERS
    return isinstance(owner, ast.Name) and owner.id in _LOGGERS
