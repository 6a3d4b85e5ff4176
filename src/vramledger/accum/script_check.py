"""Read a training script (never run or import it) and point at gradient-accumulation mistakes, by line.

The script is parsed with ``ast``. A loop is an *accumulation loop* when it calls ``backward`` on every
iteration but steps the optimizer less often, in one of three shapes:

* **guard**: ``for step, batch in …: loss.backward(); if (step + 1) % accum == 0: optimizer.step()``;
* **inner loop**: ``for micro in range(accum): … loss.backward()`` with ``optimizer.step()`` after the loop
  (nanoGPT's ``train.py``);
* **accelerate**: ``with accelerator.accumulate(model): accelerator.backward(loss); optimizer.step(); …``.

Inside an accumulation loop, a statement that is not under an accumulation guard (an ``if`` whose test uses
``%`` or names like ``accum``, ``micro``, ``sync_gradients``) runs on every micro-batch. Rules:

* ACC001 scheduler-per-micro-batch: ``scheduler.step()`` runs per micro-batch, so the LR schedule runs
  ``accum``× too fast. Under accelerate this is correct only for a scheduler passed through
  ``accelerator.prepare``: ``AcceleratedScheduler.step`` (accelerate 1.15 ``scheduler.py``) returns early
  while ``gradient_state.sync_gradients`` is False.
* ACC002 loss-not-scaled: the loss reaches ``backward`` without being divided by the accumulation steps (or
  normalised by a token count), so the accumulated gradient is ``accum``× the large-batch gradient. Under
  accelerate, ``Accelerator.backward`` (accelerate 1.15 ``accelerator.py``) is what divides by
  ``gradient_accumulation_steps``, so a bare ``loss.backward()`` is not scaled.
* ACC003 zero-grad-per-micro-batch: ``zero_grad()`` runs per micro-batch and wipes what was accumulated.
  ``AcceleratedOptimizer.zero_grad`` (accelerate 1.15 ``optimizer.py``) only clears when
  ``sync_gradients``, so it is correct on a prepared optimizer (but not on the model).

Any division of the loss counts as scaling (the divisor's value is unknown before running). These are
heuristics on names and structure; a loop built very differently is not recognised (and not
flagged). The check reports the loops it recognised so that silence can be told apart from blindness.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vramledger.errors import VramledgerError

RULES: dict[str, str] = {
    "ACC001": "scheduler-per-micro-batch",
    "ACC002": "loss-not-scaled",
    "ACC003": "zero-grad-per-micro-batch",
}

_GUARD_IDENT = re.compile(r"accum|sync_grad|micro|grad_acc|(^|_)gas($|_)|(^|_)ga_steps")
_SCHED_CALL = re.compile(r"(?i:schedul|warmup)|LR$|LROnPlateau$|WarmRestarts$")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    line: int
    rule: str
    """``ACC001``…``ACC003``; ``RULES[rule]`` is its short name."""
    message: str
    """What is wrong, in one sentence."""
    fix: str
    """What to change, in one sentence."""

    @property
    def name(self) -> str:
        return RULES[self.rule]


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumulationLoop:
    line: int
    kind: str
    """``guard``, ``inner loop`` or ``accelerate``."""
    detail: str
    """How it was recognised, e.g. ``optimizer steps under `if (step + 1) % accum == 0` (line 41)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScriptReport:
    path: str
    loops: tuple[AccumulationLoop, ...]
    findings: tuple[Finding, ...]

    @property
    def clean(self) -> bool:
        return not self.findings


@dataclass(slots=True)
class _Call:
    kind: str  # backward | sched_step | opt_step | zero_grad
    node: ast.Call
    receiver: str
    guard: ast.If | None  # innermost enclosing accumulation guard within the loop
    in_accumulate: bool  # inside `with accelerator.accumulate(...)`
    loss: ast.expr | None = None  # for backward: the loss expression
    via_accelerator: bool = False  # for backward: accelerator.backward(loss)


def check_script(path: str | Path) -> ScriptReport:
    """Parse ``path`` and check its accumulation loops; unreadable or invalid → VramledgerError (exit 2)."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VramledgerError(f"--script {path}: cannot read it ({reason}); give a Python training script") from exc
    return check_source(source, filename=str(path))


def check_source(source: str, *, filename: str = "<script>") -> ScriptReport:
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise VramledgerError(
            f"--script {filename}:{exc.lineno}: not valid Python ({exc.msg}); the check parses the file, "
            "so it must be a Python source file"
        ) from exc
    return _Checker(tree, filename).run()


def _dotted(e: ast.AST) -> str:
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Attribute):
        return f"{_dotted(e.value)}.{e.attr}"
    if isinstance(e, ast.Call):
        return f"{_dotted(e.func)}()"
    if isinstance(e, ast.Subscript):
        return f"{_dotted(e.value)}[]"
    return "<expr>"


def _last(e: ast.AST) -> str:
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Attribute):
        return e.attr
    if isinstance(e, ast.Call):
        return _last(e.func)
    return ""


def _is_accum_guard(test: ast.expr) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
            return True
        ident = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if ident and _GUARD_IDENT.search(ident.lower()):
            return True
    return False


def _guard_divisor(test: ast.expr) -> str | None:
    for n in ast.walk(test):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
            return ast.unparse(n.right)
    for n in ast.walk(test):
        if isinstance(n, (ast.Name, ast.Attribute)) and "accum" in _last(n).lower():
            return ast.unparse(n)
    return None


def _targets(t: ast.expr) -> Iterator[str]:
    if isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _targets(e)
    elif isinstance(t, ast.Starred):
        yield from _targets(t.value)
    else:
        yield _dotted(t)


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not enter nested functions, classes or lambdas (their names are not ours)."""
    todo = [scope]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, _SCOPES))


def _finding(c: _Call, rule: str, message: str, fix: str) -> Finding:
    return Finding(line=c.node.lineno, rule=rule, message=message, fix=fix)


class _Checker:
    def __init__(self, tree: ast.Module, filename: str) -> None:
        self.tree = tree
        self.filename = filename
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.schedulers: set[str] = set()
        self.accelerators: set[str] = set()
        self.prepared: set[str] = set()
        self.accelerator_scales = False  # Accelerator(gradient_accumulation_steps=…) seen
        self._scan_module()

    # -- what the whole file tells us about names ---------------------------------------------------------
    def _scan_module(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
            elif (
                isinstance(node, ast.Call)
                and _last(node.func) == "Accelerator"
                and any(k.arg == "gradient_accumulation_steps" for k in node.keywords)
            ):
                self.accelerator_scales = True
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n for t in targets for n in _targets(t)]
            value = node.value
            if isinstance(value, ast.Call):
                callee = _last(value.func)
                if _SCHED_CALL.search(callee):
                    self.schedulers.update(names)
                elif callee == "Accelerator":
                    self.accelerators.update(names)
                elif callee == "prepare" and self._is_accelerator(
                    value.func.value if isinstance(value.func, ast.Attribute) else value.func
                ):
                    self.prepared.update(names)
                    self.prepared.update(_dotted(a) for a in value.args)

    def _is_accelerator(self, e: ast.AST) -> bool:
        return _dotted(e) in self.accelerators or "accelerator" in _last(e).lower()

    def _is_scheduler(self, e: ast.AST) -> bool:
        return _dotted(e) in self.schedulers or "sched" in _last(e).lower()

    # -- per-loop analysis --------------------------------------------------------------------------------
    def run(self) -> ScriptReport:
        loops: list[AccumulationLoop] = []
        findings: list[Finding] = []
        for node in ast.walk(self.tree):
            if isinstance(node, _LOOPS):
                self._check_loop(node, loops, findings)
        findings.sort(key=lambda f: (f.line, f.rule))
        loops.sort(key=lambda lp: lp.line)
        return ScriptReport(path=self.filename, loops=tuple(loops), findings=tuple(findings))

    def _check_loop(
        self, loop: ast.For | ast.AsyncFor | ast.While, loops: list[AccumulationLoop], findings: list[Finding]
    ) -> None:
        calls: list[_Call] = []
        self._collect(loop.body, None, False, calls)
        backwards = [c for c in calls if c.kind == "backward"]
        if not backwards:
            return
        opt_steps = [c for c in calls if c.kind == "opt_step"]
        if any(c.in_accumulate for c in backwards):
            loops.append(
                AccumulationLoop(
                    line=loop.lineno,
                    kind="accelerate",
                    detail="`with accelerator.accumulate(...)` in its body",
                )
            )
            self._check_accelerate(loop, calls, findings)
            return
        guarded_steps = [c for c in opt_steps if c.guard is not None]
        if guarded_steps and any(c.guard is None for c in backwards):
            guard = guarded_steps[0].guard
            assert guard is not None
            test = ast.unparse(guard.test)
            loops.append(
                AccumulationLoop(
                    line=loop.lineno,
                    kind="guard",
                    detail=f"optimizer steps under `if {test}:` (line {guard.lineno})",
                )
            )
            step = guarded_steps[0].node
            self._check_manual(
                loop,
                calls,
                findings,
                divisor=_guard_divisor(guard.test),
                where=f"under `if {test}:` (line {guard.lineno}), right after `{ast.unparse(step)}`",
            )
            return
        if opt_steps:
            return  # the optimizer steps on every iteration: no accumulation here
        after = self._optimizer_step_after(loop)
        if after is None:
            return
        divisor = None
        if (
            isinstance(loop, (ast.For, ast.AsyncFor))
            and isinstance(loop.iter, ast.Call)
            and _last(loop.iter.func) == "range"
            and loop.iter.args
        ):
            divisor = ast.unparse(loop.iter.args[-1] if len(loop.iter.args) == 1 else loop.iter.args[1])
        loops.append(
            AccumulationLoop(
                line=loop.lineno,
                kind="inner loop",
                detail=f"backward per iteration, `{ast.unparse(after)}` after the loop (line {after.lineno})",
            )
        )
        self._check_manual(
            loop,
            calls,
            findings,
            divisor=divisor,
            where=f"after the micro-batch loop, right after `{ast.unparse(after)}` (line {after.lineno})",
        )

    def _optimizer_step_after(self, loop: ast.AST) -> ast.Call | None:
        parent = self.parents.get(loop)
        if parent is None:
            return None
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and loop in block:
                calls: list[_Call] = []
                self._collect(block[block.index(loop) + 1 :], None, False, calls)
                steps = [c for c in calls if c.kind == "opt_step"]
                return steps[0].node if steps else None
        return None

    def _collect(self, stmts: Sequence[ast.stmt], guard: ast.If | None, in_acc: bool, out: list[_Call]) -> None:
        """Calls that run in this loop's iterations (not in nested loops or nested definitions)."""
        for st in stmts:
            if isinstance(st, (_SCOPES, _LOOPS)):
                continue
            if isinstance(st, ast.If):
                self._calls_in(st.test, guard, in_acc, out)
                self._collect(st.body, st if _is_accum_guard(st.test) else guard, in_acc, out)
                self._collect(st.orelse, guard, in_acc, out)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                acc = in_acc
                for item in st.items:
                    self._calls_in(item.context_expr, guard, in_acc, out)
                    ce = item.context_expr
                    if (
                        isinstance(ce, ast.Call)
                        and _last(ce.func) == "accumulate"
                        and isinstance(ce.func, ast.Attribute)
                        and self._is_accelerator(ce.func.value)
                    ):
                        acc = True
                self._collect(st.body, guard, acc, out)
            elif isinstance(st, ast.Try):
                for block in (st.body, *(h.body for h in st.handlers), st.orelse, st.finalbody):
                    self._collect(block, guard, in_acc, out)
            elif isinstance(st, ast.Match):
                for case in st.cases:
                    self._collect(case.body, guard, in_acc, out)
            else:
                self._calls_in(st, guard, in_acc, out)

    def _calls_in(self, node: ast.AST, guard: ast.If | None, in_acc: bool, out: list[_Call]) -> None:
        for n in ast.walk(node):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            recv = n.func.value
            attr = n.func.attr
            call = _Call(kind="", node=n, receiver=_dotted(recv), guard=guard, in_accumulate=in_acc)
            if attr == "backward":
                call.kind = "backward"
                if n.args and self._is_accelerator(recv):
                    call.loss, call.via_accelerator = n.args[0], True
                elif n.args and _last(recv) == "autograd":  # torch.autograd.backward(loss)
                    call.loss = n.args[0]
                else:
                    call.loss = recv
                    # scaler.scale(loss).backward(): the AMP scale is not an accumulation scale.
                    if isinstance(recv, ast.Call) and _last(recv.func) == "scale" and recv.args:
                        call.loss = recv.args[0]
            elif attr == "step":
                call.kind = "sched_step" if self._is_scheduler(recv) else "opt_step"
            elif attr == "zero_grad":
                call.kind = "zero_grad"
            else:
                continue
            out.append(call)

    # -- rules ----------------------------------------------------------------------------------------------
    def _check_manual(
        self, loop: ast.stmt, calls: list[_Call], findings: list[Finding], *, divisor: str | None, where: str
    ) -> None:
        n = divisor or "gradient_accumulation_steps"
        at = f"the accumulation loop at line {loop.lineno}"
        for c in calls:
            if c.guard is not None:
                continue
            if c.kind == "sched_step":
                msg = (
                    f"`{c.receiver}.step()` runs on every micro-batch of {at}, so the LR schedule "
                    f"advances `{n}` times per optimizer step and warmup/decay end early."
                )
                findings.append(_finding(c, "ACC001", msg, f"move it {where}."))
            elif c.kind == "zero_grad":
                msg = (
                    f"`{c.receiver}.zero_grad()` runs on every micro-batch of {at}, wiping the gradients "
                    "accumulated so far: the optimizer sees only the last micro-batch."
                )
                findings.append(_finding(c, "ACC003", msg, f"call it {where}."))
            elif c.kind == "backward" and not self._backward_scaled(c, loop):
                loss = ast.unparse(c.loss) if c.loss is not None else "loss"
                msg = (
                    f"`{loss}` reaches backward undivided in {at}, so the accumulated gradient is `{n}` "
                    "times the large-batch gradient (and gradient clipping thresholds change meaning)."
                )
                fix = (
                    f"backward `{loss} / {n}`, or sum the token losses and divide by the optimizer step's "
                    "total target tokens (transformers' num_items_in_batch)."
                )
                findings.append(_finding(c, "ACC002", msg, fix))

    def _check_accelerate(self, loop: ast.stmt, calls: list[_Call], findings: list[Finding]) -> None:
        at = f"the accumulate loop at line {loop.lineno}"
        for c in calls:
            if c.guard is not None:
                continue
            if c.kind == "sched_step" and c.receiver not in self.prepared:
                msg = (
                    f"`{c.receiver}` was not passed through `accelerator.prepare`, so its `.step()` in {at} "
                    "advances the LR schedule on every micro-batch."
                )
                fix = (
                    f"pass `{c.receiver}` to `accelerator.prepare(...)`, or step it under "
                    "`if accelerator.sync_gradients:`."
                )
                findings.append(_finding(c, "ACC001", msg, fix))
            elif c.kind == "zero_grad" and (c.receiver not in self.prepared or "model" in c.receiver.lower()):
                msg = (
                    f"`{c.receiver}.zero_grad()` is not a prepared optimizer's, so it clears the gradients "
                    f"on every micro-batch of {at}."
                )
                fix = "call `zero_grad()` on the optimizer returned by `accelerator.prepare`."
                findings.append(_finding(c, "ACC003", msg, fix))
            elif c.kind == "backward" and not c.via_accelerator and not self._backward_scaled(c, loop):
                loss = ast.unparse(c.loss) if c.loss is not None else "loss"
                msg = (
                    f"`{loss}.backward()` in {at} bypasses `accelerator.backward`, which is where accelerate "
                    "divides the loss by gradient_accumulation_steps."
                )
                findings.append(_finding(c, "ACC002", msg, f"call `accelerator.backward({loss})` instead."))

    # -- is the loss scaled? --------------------------------------------------------------------------------
    def _backward_scaled(self, c: _Call, loop: ast.AST) -> bool:
        if c.via_accelerator and (self.accelerator_scales or c.in_accumulate):
            return True  # Accelerator.backward divides by gradient_accumulation_steps
        if c.loss is None:
            return False
        return self._scaled(c.loss, self._scope_of(loop), c.node.lineno, 0)

    def _scope_of(self, node: ast.AST) -> ast.AST:
        p = self.parents.get(node)
        while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            p = self.parents.get(p)
        return p if p is not None else self.tree

    def _scaled(self, e: ast.expr, scope: ast.AST, before: int, depth: int) -> bool:
        if depth > 6:
            return False
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, (ast.Div, ast.FloorDiv)):
                return True
            if isinstance(e.op, ast.Mult) and any(
                isinstance(s, ast.Constant)
                and isinstance(s.value, float)
                and 0 < s.value < 1
                or "accum" in _last(s).lower()
                for s in (e.left, e.right)
            ):
                return True
            return any(self._scaled(s, scope, before, depth + 1) for s in (e.left, e.right))
        if isinstance(e, (ast.Attribute, ast.Subscript)):
            return self._scaled(e.value, scope, before, depth + 1)
        if isinstance(e, ast.Call):
            if any(k.arg == "num_items_in_batch" for k in e.keywords):
                return True  # the model divides its summed loss by the global target count
            fn = self.functions.get(_last(e.func))
            if fn is not None:
                return any(
                    r.value is not None and self._scaled(r.value, fn, 10**9, depth + 1)
                    for r in ast.walk(fn)
                    if isinstance(r, ast.Return)
                )
            return False
        if isinstance(e, ast.Name):
            for node in _walk_scope(scope):
                if getattr(node, "lineno", before + 1) > before:
                    continue
                if (
                    isinstance(node, ast.AugAssign)
                    and _dotted(node.target) == e.id
                    and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mult))
                ):
                    return True
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if e.id in {n for t in targets for n in _targets(t)} and self._scaled(
                        node.value, scope, node.lineno - 1, depth + 1
                    ):
                        return True
        return False
