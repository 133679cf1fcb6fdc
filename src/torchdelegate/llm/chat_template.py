"""A checkpoint's chat template, rendered within bounds: jinja2's immutable sandbox gives a template
from a file no access to Python beyond the values passed; the bounds here keep it from running on
without end or making text without end, whatever it and the conversation hold.

A server renders the template of the file it serves for any client that sends messages, so a
template that loops 10^10 times, or doubles a text 60 times, must fail fast with an error naming the
template, never hold a thread or fill the memory.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdelegate.errors import CheckpointError

TEMPLATE_STEPS = 1_000_000
"""Steps a chat template may take to render one conversation: loop iterations, calls, attribute and
item reads, operators. Common templates take some tens a message."""
TEMPLATE_SECONDS = 2.0
"""Seconds a chat template may take to render one conversation (common ones take milliseconds)."""
TEMPLATE_CHARACTERS = 16 << 20
"""Characters (or items) in any text or list a chat template makes, its output included."""
TEMPLATE_MADE = 4 * TEMPLATE_CHARACTERS
"""Characters (or items) a chat template may make in all, over one render: what bounds its memory."""
TEMPLATE_JSON_INDENT = 64
"""The widest indent ``tojson`` may be given (each line of the JSON repeats it)."""


class ChatTemplate:
    """The checkpoint's chat template, which turns a conversation into the text the model reads.

    It is rendered in jinja2's immutable sandbox, which gives a template from a file no access to
    Python beyond the values passed, and within bounds a template cannot pass: :data:`TEMPLATE_STEPS`
    steps (loop iterations, calls, attribute and item reads, operators), :data:`TEMPLATE_SECONDS`
    seconds, :data:`TEMPLATE_CHARACTERS` characters in any text or list it makes, its output included,
    and :data:`TEMPLATE_MADE` in all. Operators, filters and text methods that multiply one size by
    another (``*``, ``replace``, ``join``, ``indent``, ...) are checked before they run. A template past
    a bound fails with a ``CheckpointError`` that says which; a render never runs on without end (a
    template's loops are jinja2's, over finite iterables, each counted)."""

    def __init__(self, path: str | Path, template: str, config: dict[str, Any]) -> None:
        self.path = path
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.template = bounded_template(template, f"{path}: its chat template")

    def render(self, messages: list[dict[str, str]]) -> str:
        """``messages`` as the text the model reads, ending where the assistant's reply begins; a
        ``CheckpointError`` when the template cannot render them, or not within its bounds."""
        budget = _RENDERING.set(_Budget(TEMPLATE_STEPS, time.monotonic() + TEMPLATE_SECONDS))
        try:
            return str(self.template.render(messages=messages, add_generation_prompt=True, **self.special))
        except _PastBound as e:
            raise CheckpointError(
                f"{self.path}: its chat template {e} rendering these messages, and was stopped: fix the template "
                "(the checkpoint's chat_template.jinja) and export again, or send a prompt rather than messages"
            ) from None
        except Exception as e:
            raise CheckpointError(f"{self.path}: its chat template cannot be rendered ({type(e).__name__}: {e})") from e
        finally:
            _RENDERING.reset(budget)


def _token_text(value: Any) -> str:
    """A special token's text as tokenizer_config.json gives it (a string, or an object with ``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass
class _Budget:
    steps: int
    deadline: float
    made: int = 0


_RENDERING: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat template budget", default=None)
_WIDE_FIELD = re.compile(r"\{[^{}]*?(\d{8,})")  # a format field with a width or precision of 8 digits or more


class _PastBound(Exception):
    """A chat template passed one of its bounds; the message says which."""


def _step() -> None:
    """Counts a step of the render under way (none at compile time, when jinja2 folds constants)."""
    budget = _RENDERING.get()
    if budget is None:
        return
    budget.steps -= 1
    if budget.steps < 0:
        raise _PastBound(f"took more than {TEMPLATE_STEPS:,} steps")
    if time.monotonic() > budget.deadline:
        raise _PastBound(f"took more than {TEMPLATE_SECONDS:g} s")


def _sized(value: Any) -> Any:
    """``value``, refused if it is a text or list past :data:`TEMPLATE_CHARACTERS`, or if the render
    has now made more than :data:`TEMPLATE_MADE` characters and items in all."""
    if isinstance(value, (str, list, tuple)):
        if len(value) > TEMPLATE_CHARACTERS:
            raise _PastBound(f"made a text or list of more than {TEMPLATE_CHARACTERS:,} items")
        budget = _RENDERING.get()
        if budget is not None:
            budget.made += len(value)
            if budget.made > TEMPLATE_MADE:
                raise _PastBound(f"made more than {TEMPLATE_MADE:,} characters and items in all")
    return value


def _growth(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The most characters the filter or text method ``name`` can make of ``subject`` with ``args``
    (0 for those whose result is no bigger than their arguments, or whose numbers bound it): each one
    here multiplies a size by another, so it is checked before it runs."""
    text = subject if isinstance(subject, str) else ""
    given: dict[int | str, Any] = dict(enumerate(args))
    given.update(kwargs)
    if name == "replace" and isinstance(given.get(0), str) and isinstance(given.get(1), str):
        count = text.count(given[0]) if given[0] else len(text) + 1
        return len(text) + count * len(given[1])
    if name == "join" and isinstance(subject, (list, tuple)):  # the filter; text.join is checked in call
        separator = given.get(0, given.get("d", ""))
        return sum(len(str(item)) for item in subject) + len(str(separator)) * len(subject)
    if name == "indent":
        width = given.get(0, given.get("width", 4))
        return len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
    if name == "wordwrap":
        return len(text) * (1 + len(str(given.get(2, given.get("wrapstring")) or "\n")))
    if name == "expandtabs":
        size = given.get(0, given.get("tabsize", 8))
        return len(text) + text.count("\t") * (size if isinstance(size, int) else 0)
    if name == "tojson":
        indent = given.get(0, given.get("indent"))
        width = indent if isinstance(indent, int) else len(str(indent or ""))
        if width > TEMPLATE_JSON_INDENT:
            raise _PastBound(f"asked for a JSON indent of {width} (more than {TEMPLATE_JSON_INDENT})")
    return 0


def _checked_growth(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if _growth(name, subject, args, kwargs) > TEMPLATE_CHARACTERS:
        raise _PastBound(f"asked {name} for a text of more than {TEMPLATE_CHARACTERS:,} characters")


def _small_numbers(values: Any) -> None:
    """Refuses any integer past :data:`TEMPLATE_CHARACTERS` among ``values``: as a width, a count or
    an exponent, it asks for more than any text a template may make."""
    for value in values:
        if isinstance(value, int) and abs(value) > TEMPLATE_CHARACTERS:
            raise _PastBound(f"asked for {value:,} of something (more than {TEMPLATE_CHARACTERS:,})")


def _counted(items: Any) -> Any:
    """A ``for`` loop's items, each a step."""
    for item in items:
        _step()
        yield item


def _bounded_filter(name: str, function: Any) -> Any:
    """``function`` (the filter ``name``) counted as a step, refusing huge numbers as arguments, a
    result that would be huge (:func:`_growth`) before it is made, and a huge one after."""
    leading = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # the context or environment

    @functools.wraps(function)  # keeps jinja2's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _step()
        head, subject, rest = args[:leading], args[leading] if len(args) > leading else None, args[leading + 1 :]
        _small_numbers([*rest, *kwargs.values()])
        if name == "join" and subject is not None and not isinstance(subject, (str, list, tuple)):
            subject = _sized(list(subject))  # an iterable read once: its items counted before they are joined
            args = (*head, subject, *rest)
        _checked_growth(name, subject, rest, kwargs)
        return _sized(function(*args, **kwargs))

    return bounded


def _binary(operator: str, left: Any, right: Any) -> Any:
    """``left operator right``, refused before it is computed when its result would pass the bounds."""
    sizes = [len(side) for side in (left, right) if isinstance(side, (str, list, tuple))]
    if operator == "*" and sizes:
        counts = [side for side in (left, right) if isinstance(side, int)]
        if counts and sizes[0] * max(counts) > TEMPLATE_CHARACTERS:
            raise _PastBound(f"made a text or list of more than {TEMPLATE_CHARACTERS:,} items")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > 1 << 16:
            raise _PastBound(f"asked for a number of more than {1 << 16:,} bits")
    elif operator == "%" and isinstance(left, str):
        _small_numbers(right if isinstance(right, tuple) else [right])
        if _WIDE_FIELD.search(left):
            raise _PastBound("asked for a field wider than any text it may make")
    elif operator == "+" and len(sizes) == 2 and sum(sizes) > TEMPLATE_CHARACTERS:
        raise _PastBound(f"made a text or list of more than {TEMPLATE_CHARACTERS:,} items")
    return None


@functools.cache
def _bounded_environment() -> type:
    """jinja2's immutable sandbox, counting each step of a render and refusing what would pass the
    bounds (a class made on first use, so that importing this module does not import jinja2)."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):  # type: ignore[misc]
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def __init__(self) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True)
            self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
            self.filters["_counted"] = _counted
            self.filters["_sized"] = _sized

        def bounded_template(self, text: str, where: str) -> Any:
            """``text`` compiled with every ``for`` loop's items counted and every ``~`` sized;
            a ``CheckpointError`` naming ``where`` if jinja2 cannot read it."""
            from jinja2 import TemplateError

            try:
                tree = self.parse(text)
            except TemplateError as e:
                raise CheckpointError(f"{where} is not a template jinja2 reads ({e})") from e
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, "_counted", [], [], None, None, lineno=loop.lineno)
            for joined in list(tree.find_all(nodes.Concat)):
                joined.nodes = [nodes.Filter(nodes.Concat(joined.nodes), "_sized", [], [], None, None)]
            return self.from_string(tree)

        def concat(self, pieces: Any) -> str:  # type: ignore[override]
            """The output, refused once it passes :data:`TEMPLATE_CHARACTERS`."""
            kept, size = [], 0
            for piece in pieces:
                size += len(piece)
                if size > TEMPLATE_CHARACTERS:
                    raise _PastBound(f"wrote more than {TEMPLATE_CHARACTERS:,} characters")
                kept.append(piece)
            return "".join(kept)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _step()
            _binary(operator, left, right)
            return _sized(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _step()
            _small_numbers([*args, *kwargs.values()])
            method = getattr(__obj, "__wrapped__", __obj)
            text = getattr(method, "__self__", None)
            if isinstance(text, str):
                if _WIDE_FIELD.search(text):
                    raise _PastBound("asked for a field wider than any text it may make")
                if method.__name__ == "join" and args:
                    items = _sized(list(args[0]))  # read once, counted, then joined
                    args = (items, *args[1:])
                    if sum(len(str(item)) for item in items) + len(text) * len(items) > TEMPLATE_CHARACTERS:
                        raise _PastBound(f"asked join for a text of more than {TEMPLATE_CHARACTERS:,} characters")
                _checked_growth(method.__name__, text, args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj: Any, attribute: str) -> Any:
            _step()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _step()
            return super().getitem(obj, argument)

    return BoundedEnvironment


def bounded_template(text: str, where: str) -> Any:
    """``text`` compiled as a jinja2 template rendered within the bounds (jinja2's ``Template``; render
    it inside :class:`ChatTemplate`'s budget, or it is unbounded in steps and time); a ``CheckpointError``
    naming ``where`` if jinja2 cannot read it."""
    return _bounded_environment()().bounded_template(text, where)
