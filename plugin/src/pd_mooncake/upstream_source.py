"""What a vLLM module's source declares, read with ``ast`` (never imported),
and the upstream names a fix needs from it (``fixes.FIXES``). Kept apart
from the fix table so a release that is not installed can be read alike."""

from __future__ import annotations

import ast
from dataclasses import dataclass

# The modules a SourceView reads, relative to the directory holding vllm/.
CONNECTOR_FILE = (
    "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py"
)
BASE_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@dataclass(frozen=True)
class Method:
    """``owner.name`` is a method with exactly these parameters after self
    (we call super() positionally), sync or async as we await it.
    ``leading``: these come first, any others follow (we pass them through)."""

    owner: str
    name: str
    params: tuple[str, ...]
    is_async: bool = False
    leading: bool = False


@dataclass(frozen=True)
class Attr:
    """``owner`` stores ``self.<name>`` somewhere (instance state we read),
    or declares it as a class-level field (msgspec structs, dataclasses)."""

    owner: str
    name: str


@dataclass(frozen=True)
class Calls:
    """``owner.method`` calls ``callee`` (a dotted name as written in the
    source): the hook our override or module swap relies on. ``absent``:
    it must not (a call that changes what our override assumes)."""

    owner: str
    method: str
    callee: str
    absent: bool = False


@dataclass(frozen=True)
class StoresOnly:
    """``owner.method`` stores no ``self`` attribute outside ``allowed``."""

    owner: str
    method: str
    allowed: frozenset[str]


Need = Method | Attr | Calls | StoresOnly


class SourceView:
    """What a module's source declares, read with ``ast`` (not imported)."""

    def __init__(self, source: str, *bases: str) -> None:
        """``source``: the Mooncake connector module; ``bases``: modules of
        its base classes (an inherited hook counts as present)."""
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for text in (*bases, source):  # the connector module's names win
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] = node
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions[node.name] = node

    def method(
        self, owner: str, name: str
    ) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        if not owner:
            return self.functions.get(name)
        cls = self.classes.get(owner)
        if cls is None:
            return None
        for node in cls.body:
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == name
            ):
                return node
        for base in cls.bases:
            found = (
                self.method(ast.unparse(base), name)
                if isinstance(base, ast.Name)
                else None
            )
            if found is not None:
                return found
        return None

    def has_attr(self, owner: str, name: str) -> bool:
        cls = self.classes.get(owner)
        if cls is None:
            return False
        for node in cls.body:  # class-level fields
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return True
        return name in _self_stores(cls)

    def problem(self, need: Need) -> str | None:
        """Why ``need`` is not met by this source, or None."""
        where = f"{need.owner}." if need.owner else ""
        if isinstance(need, Attr):
            if not self.has_attr(need.owner, need.name):
                return f"{where}{need.name} is never set"
            return None
        name = need.name if isinstance(need, Method) else need.method
        node = self.method(need.owner, name)
        if node is None:
            return f"{where}{name} is missing"
        if isinstance(need, Method):
            params = tuple(a.arg for a in [*node.args.posonlyargs, *node.args.args])
            params = params[1:] if need.owner else params
            if need.leading:
                params = params[: len(need.params)]
            is_async = isinstance(node, ast.AsyncFunctionDef)
            if params != need.params or is_async != need.is_async:
                got = f"{'async ' if is_async else ''}({', '.join(params)})"
                want = f"{'async ' if need.is_async else ''}({', '.join(need.params)})"
                return f"{where}{name} is {got}, the plugin needs {want}"
            return None
        if isinstance(need, Calls):
            called = {
                ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)
            }
            if (need.callee in called) == need.absent:
                verb = "now calls" if need.absent else "no longer calls"
                return f"{where}{name} {verb} {need.callee}"
            return None
        extra = sorted(_self_stores(node) - need.allowed)
        if extra:
            return f"{where}{name} now also sets {', '.join(extra)}"
        return None


def _self_stores(node: ast.AST) -> set[str]:
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
